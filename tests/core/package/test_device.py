import pytest
import torch

from ember_core.device import available_memory, resolve_dtype


def test_explicit_dtypes_win_over_auto() -> None:
    cpu = torch.device("cpu")
    assert resolve_dtype("float32", cpu) is torch.float32
    assert resolve_dtype("bf16", cpu) is torch.bfloat16
    with pytest.raises(ValueError, match="ember_core.auto_dtype decides it"):
        resolve_dtype(None, cpu)  # a CPU's auto needs the model's numerics and weights


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
