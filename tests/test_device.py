import torch

from ember_core.device import cpu_has_fast_bf16, resolve_dtype


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
