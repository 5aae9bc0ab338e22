import torch

from ember_core.device import available_memory, cpu_has_fast_bf16, resolve_dtype


def test_bf16_is_fast_only_with_native_bf16_instructions(tmp_path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni\n")
    assert cpu_has_fast_bf16(cpuinfo)
    cpuinfo.write_text("flags\t\t: fpu sse avx2 fma\n")
    assert not cpu_has_fast_bf16(cpuinfo)
    assert not cpu_has_fast_bf16(tmp_path / "missing")


def test_explicit_dtypes_win_over_auto() -> None:
    cpu = torch.device("cpu")
    assert resolve_dtype("float32", cpu) is torch.float32
    assert resolve_dtype("bf16", cpu) is torch.bfloat16
    assert resolve_dtype(None, cpu) in (torch.float32, torch.bfloat16)


def test_available_memory_is_memavailable_or_less_under_a_cgroup_limit(tmp_path) -> None:
    cpu = torch.device("cpu")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert available_memory(cpu, meminfo, cgroup) == 20000000 * 1024  # no cgroup files: a host
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.stat").write_text("anon 1000\nfile 5000\n")
    assert available_memory(cpu, meminfo, cgroup) == 20000000 * 1024  # no limit
    (cgroup / "memory.max").write_text(f"{2 * 2**30}\n")
    (cgroup / "memory.stat").write_text(f"anon {2**30}\nfile {2**29}\n")
    assert available_memory(cpu, meminfo, cgroup) == 2**30  # the page cache can be reclaimed
    assert available_memory(cpu, tmp_path / "missing", cgroup) is None
    assert available_memory(torch.device("meta")) is None
