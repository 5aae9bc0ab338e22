"""`ember bench kernels`: ember's CPU kernels against this machine's own peak.

The peak: register-only loops of the widest float32 multiply-add, of the 8-bit integer dot product
(`vpdpbusd` with AVX512-VNNI, `vpmaddubsw` + `vpmaddwd` on AVX2) and of the bfloat16 dot product
(`vdpbf16ps`, where the CPU has it) on every thread (kernels/peak.cpp), and the read bandwidth of
summing a tensor far larger than the caches. Each kernel then runs on SmolLM2-135M's shapes, its
30 layers' weights each their own tensor so they stream from memory as in a decode step, through
the modules a model uses (`SmallBatchLinear`, `GGUFBlockLinear`: the path ember takes at that row
count and dtype; block formats also under the fast numerics, "int8"), and is reported as GF/s (or
integer G ops/s), GB/s and its share of the peak of its arithmetic.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import gguf
import torch
from torch import nn

from ember_bench.kernel_attention import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, SCALE, StepInputs, make_inputs
from ember_core.kernels import cpu_ops
from ember_core.layers.kv_quant import kv_cache_dtype_name
from ember_core.layers.linear import GGUFBlockLinear, SmallBatchLinear

HIDDEN, INTERMEDIATE, QKV, VOCAB, LAYERS = 576, 1536, 960, 49152, 30
LAYER_SHAPES = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
# F32 / BF16: dense weights of that dtype. No K-quants: their 256-value super-blocks do not divide
# SmolLM2's 576-wide rows (llama.cpp's converter falls back to Q4_1 / Q8_0 for them too).
FORMATS = ("F32", "BF16", "Q8_0", "Q4_1", "Q4_0", "Q5_1")
BLOCK_FORMATS = FORMATS[2:]
REFERENCE_KERNEL = "layer linears BF16, torch F.linear (oneDNN)"
PEAK_SECONDS = 0.25
READ_BYTES = 1 << 30


@dataclass(frozen=True)
class Peak:
    fma_gflops: float
    bf16_dot_gflops: float | None  # None: the CPU has no AVX512-BF16
    read_gbps: float
    int8_dot_gops: float | None  # None: a build without AVX2


@dataclass(frozen=True)
class KernelTiming:
    kernel: str
    dtype: str  # of the activations: float32 or bfloat16
    rows: int
    seconds: float  # median of the repeats, one call of everything the row covers
    flops: float
    bytes: float  # weights (or K/V) read, plus activations in and out
    int8: bool = False  # the fast numerics: integer products of int8 activations and the blocks

    @property
    def gflops(self) -> float:
        return self.flops / self.seconds / 1e9

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9


def measure_peak(repeats: int = 3) -> Peak:
    ops = cpu_ops.ops()

    def loop_gflops(kind: str) -> float:
        iterations = 1 << 16
        while True:  # grow until a call takes long enough to time
            started = time.perf_counter()
            flops = ops.peak_loop(kind, iterations)
            seconds = time.perf_counter() - started
            if seconds >= PEAK_SECONDS / 4:
                break
            iterations *= 4
        best = flops / seconds
        for _ in range(repeats):
            started = time.perf_counter()
            flops = ops.peak_loop(kind, iterations)
            best = max(best, flops / (time.perf_counter() - started))
        return best / 1e9

    has_bf16_dot = cpu_ops.active_instruction_set().name in ("avx512bf16", "amx")
    data = torch.ones(READ_BYTES // 4)
    read = min(_timed(lambda: data.sum()) for _ in range(repeats))
    return Peak(loop_gflops("fma"), loop_gflops("bf16_dot") if has_bf16_dot else None, READ_BYTES / read / 1e9,
                loop_gflops("int8_dot") if cpu_ops.active_instruction_set().name != "baseline" else None)


def _timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _linear(weight: torch.Tensor, form: str, int8: bool = False) -> nn.Module:
    """weight (float32) as the module a model holds for it in this format (`int8`: under the fast numerics)."""
    if form in ("F32", "BF16"):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        linear.weight = nn.Parameter(weight.to(torch.float32 if form == "F32" else torch.bfloat16), requires_grad=False)
        return SmallBatchLinear.sharing(linear)
    kind = gguf.GGMLQuantizationType[form]
    blocks = torch.from_numpy(gguf.quants.quantize(weight.numpy(), kind))
    linear = GGUFBlockLinear(blocks, kind, weight.shape[1], None)
    linear.int8 = int8
    return linear


def _torch_linear(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


def _weight_bytes(module: nn.Module) -> int:
    tensors = [module.blocks] if isinstance(module, GGUFBlockLinear) else [module.weight]
    return sum(t.numel() * t.element_size() for t in tensors)


def _time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: builds, first touches
    return statistics.median(_timed(fn) for _ in range(repeats))


def linear_timings(
    forms: tuple[str, ...], rows: tuple[int, ...], dtypes: tuple[torch.dtype, ...], repeats: int, layers: int = LAYERS
) -> Iterator[KernelTiming]:
    """A decode step's layer linears (of every layer) per weight format, block formats in both
    numerics, and the Q8_0 head (the packaged SmolLM2's), per row count and dtype."""
    generator = torch.Generator().manual_seed(0)
    shapes = LAYER_SHAPES * layers
    weights = [torch.randn(shape, generator=generator) * 0.05 for shape in shapes]
    for form in forms:
        for int8 in (False, True) if form in BLOCK_FORMATS else (False,):
            modules = [_linear(weight, form, int8) for weight in weights]
            yield from _linear_rows(f"layer linears {form}{', int8' if int8 else ''}", modules, rows, dtypes, repeats)
            del modules
    if "BF16" in forms and torch.bfloat16 in dtypes:
        # The bar ember's bfloat16 path is held to: torch's own bf16 GEMM (oneDNN) on the same dense
        # weights. On a CPU with AMX, ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 with EMBER_CPU_ISA=avx512bf16
        # compares both vdpbf16ps paths.
        modules = [_torch_linear(weight.bfloat16()) for weight in weights]
        yield from _linear_rows(REFERENCE_KERNEL, modules, rows, (torch.bfloat16,), repeats)
        del modules
    head_weight = torch.randn(VOCAB, HIDDEN, generator=generator) * 0.05
    yield from _linear_rows("head Q8_0", [_linear(head_weight, "Q8_0")], rows, dtypes, repeats)
    yield from _linear_rows("head Q8_0, int8", [_linear(head_weight, "Q8_0", int8=True)], rows, dtypes, repeats)


def _linear_rows(
    name: str, modules: list[nn.Module], rows: tuple[int, ...], dtypes: tuple[torch.dtype, ...], repeats: int
) -> Iterator[KernelTiming]:
    weight_bytes = sum(_weight_bytes(module) for module in modules)
    for dtype in dtypes:
        if not _runs_in(modules[0], dtype):
            continue
        for count in rows:
            inputs = {k: torch.randn(count, k).to(dtype) for k in {module.in_features for module in modules}}
            flops = sum(2 * count * module.in_features * module.out_features for module in modules)
            activations = sum(count * (module.in_features + module.out_features) for module in modules)
            with torch.inference_mode():
                seconds = _time(functools.partial(_run_each, modules, inputs), repeats)
            yield KernelTiming(name, _dtype_name(dtype), count, seconds, flops,
                               weight_bytes + activations * (2 if dtype == torch.bfloat16 else 4),
                               int8=getattr(modules[0], "int8", False))


def _run_each(modules: list[nn.Module], inputs: dict[int, torch.Tensor]) -> None:
    """Each module on the input of its width."""
    for module in modules:
        module(inputs[module.in_features])


def _runs_in(module: nn.Module, dtype: torch.dtype) -> bool:
    """Whether a model of this dtype runs this module: GGUF blocks run in either, a dense weight in its own."""
    return isinstance(module, GGUFBlockLinear) or module.weight.dtype == dtype


# (query, cache) dtypes of a float32 model and of a bfloat16 one, over their own cache and narrower ones.
ATTENTION_DTYPES = tuple(
    (query, cache)
    for query, caches in (
        (torch.float32, (torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn)),
        (torch.bfloat16, (torch.bfloat16, torch.int8, torch.float8_e4m3fn)),
    )
    for cache in caches
)


def attention_timings(batches: tuple[int, ...], context: int, repeats: int, layers: int = LAYERS) -> Iterator[KernelTiming]:
    """Paged decode attention of every layer, float32 and bfloat16 queries over the caches each may keep."""
    for query_dtype, cache_dtype in ATTENTION_DTYPES:
        for batch in batches:
            inputs = make_inputs(batch, cache_dtype, layers, context, context)
            query = inputs.query.to(query_dtype)

            def step(query: torch.Tensor = query, inputs: StepInputs = inputs) -> None:
                for layer in range(layers):
                    cpu_ops.paged_decode_attention(query, inputs.key_caches[layer], inputs.value_caches[layer],
                                                   inputs.block_tables_int32, inputs.context_lens, SCALE)

            positions = batch * context * layers
            flops = 4 * positions * NUM_HEADS * HEAD_DIM  # q.k and p.v, a multiply-add each
            kv_bytes = 2 * positions * NUM_KV_HEADS * inputs.key_caches[0].shape[-1] * inputs.key_caches[0].element_size()
            yield KernelTiming(f"paged attention, {kv_cache_dtype_name(cache_dtype)} K/V, context {context}",
                               _dtype_name(query_dtype), batch, _time(step, repeats), flops, kv_bytes)


def kernel_table(timings: list[KernelTiming], peak: Peak) -> str:
    """One line a timing: ms, GF/s, GB/s, and shares of the compute peak of its arithmetic (int8 dot
    products, else that of its dtype) and of the read bandwidth."""
    header = f"{'kernel':<44}{'dtype':>10}{'rows':>6}{'ms':>9}{'GF/s':>8}{'GB/s':>8}{'% peak':>8}{'% read':>8}"
    lines = [header]
    for t in timings:
        compute_peak = peak.bf16_dot_gflops if t.dtype == "bfloat16" and peak.bf16_dot_gflops else peak.fma_gflops
        if t.int8:
            compute_peak = peak.int8_dot_gops
        share = f"{t.gflops / compute_peak:>8.0%}" if compute_peak else f"{'-':>8}"
        lines.append(
            f"{t.kernel:<44}{t.dtype:>10}{t.rows:>6}{t.seconds * 1e3:>9.2f}{t.gflops:>8.1f}{t.gbps:>8.1f}"
            f"{share}{t.gbps / peak.read_gbps:>8.0%}"
        )
    return "\n".join(lines)


def peak_summary(peak: Peak) -> str:
    bf16 = f"{peak.bf16_dot_gflops:.0f} GF/s" if peak.bf16_dot_gflops else "none (no AVX512-BF16)"
    int8 = f"{peak.int8_dot_gops:.0f} G ops/s" if peak.int8_dot_gops else "none (no AVX2)"
    return (f"peak on {torch.get_num_threads()} threads ({cpu_ops.active_instruction_set().name} build): "
            f"float32 FMA {peak.fma_gflops:.0f} GF/s, bfloat16 dot {bf16}, int8 dot {int8}, "
            f"read {peak.read_gbps:.1f} GB/s")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def decode_layer_timings(dtypes: tuple[torch.dtype, ...], rows: int, steps: int = 24) -> Iterator[KernelTiming]:
    """The packaged SmolLM2 model's fused decode layer (`decoder_layer_`: norms, linears from the
    file's Q4_1 / Q8_0 blocks, rotary, K/V write, paged attention) per call at `rows` sequences,
    from a profile of decode steps, beside its own linears alone at the same rows."""
    from ember_core import LLM, SamplingParams

    for dtype in dtypes:
        llm = LLM(dtype=_dtype_name(dtype), max_num_seqs=rows)
        prompts = [[100 + 7 * i + j for j in range(64)] for i in range(rows)]
        params = SamplingParams(max_tokens=steps, ignore_eos=True)
        llm.generate(prompts, params)  # warm-up
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            llm.generate(prompts, params)
        calls = [event for event in profile.key_averages() if event.key.endswith("decoder_layer_")]
        layers = llm.engine.loaded.model.layers
        linears = [linear for layer in layers for linear in _own_linears(layer)]
        flops = sum(2 * rows * linear.in_features * linear.out_features for linear in linears) / len(layers)
        weight_bytes = sum(_weight_bytes(linear) for linear in linears) / len(layers)
        if calls:
            per_call = calls[0].cpu_time_total / calls[0].count / 1e6
            yield KernelTiming("decode layer, fused (SmolLM2 GGUF)", _dtype_name(dtype), rows, per_call, flops, weight_bytes)
        inputs = {k: torch.randn(rows, k).to(dtype) for k in {linear.in_features for linear in linears}}
        with torch.inference_mode():
            seconds = _time(functools.partial(_run_each, linears, inputs), 5) / len(layers)
        yield KernelTiming("its linears alone, per layer", _dtype_name(dtype), rows, seconds, flops, weight_bytes)
        del llm


def _own_linears(layer: nn.Module) -> list[nn.Module]:
    attention, mlp = layer.self_attn, layer.mlp
    return [attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj]
