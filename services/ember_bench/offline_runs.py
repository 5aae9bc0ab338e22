"""What `ember bench offline` compares and records: engine settings, and one run's figures. No
torch here: the reports and plots read these without loading a model."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ember_bench.stats import Distribution
from ember_core.config import Admission, Batching, GGUFWeights

COMPARE_AXES: dict[str, tuple[str | bool, str | bool]] = {
    "batching": ("continuous", "static"),
    "admission": ("preempt", "reserve"),
    "dtype": ("float32", "bfloat16"),
    "gguf_weights": ("blocks", "dequantized"),
    "prefix_caching": (True, False),
    "structured_outputs": (False, True),
    "numerics": ("exact", "fast"),
}


@dataclass(frozen=True)
class EngineSetting:
    batching: Batching = "continuous"
    admission: Admission = "preempt"
    dtype: str = "float32"
    gguf_weights: GGUFWeights = "blocks"
    prefix_caching: bool = True
    # every request's output constrained to a JSON schema (offline.LONG_JSON) that runs to max_tokens
    structured_outputs: bool = False
    numerics: str = "exact"  # or "fast"

    @property
    def label(self) -> str:
        label = f"{self.batching}/{self.admission}/{self.dtype}"
        label = label if self.gguf_weights == "blocks" else f"{label}/gguf-dequantized"
        label = label if self.prefix_caching else f"{label}/no-prefix-cache"
        label = label if self.numerics == "exact" else f"{label}/{self.numerics}"
        return f"{label}/json-schema" if self.structured_outputs else label


def settings_to_compare(baseline: EngineSetting, compare: list[str]) -> list[EngineSetting]:
    """The baseline, then per compared axis the baseline with only that axis switched."""
    unknown = [axis for axis in compare if axis not in COMPARE_AXES]
    if unknown:
        raise ValueError(f"unknown --compare key {unknown[0]!r}; choose from {', '.join(COMPARE_AXES)}")
    settings = [baseline]
    for axis in dict.fromkeys(compare):
        first, second = COMPARE_AXES[axis]
        settings.append(replace(baseline, **{axis: second if getattr(baseline, axis) == first else first}))
    return settings


@dataclass(frozen=True)
class OfflineRun:
    system: str  # "ember" or "transformers"
    setting: EngineSetting
    concurrency: int
    num_requests: int
    output_tokens: int  # useful tokens only: what the requests asked for
    duration_s: float
    output_throughput: float
    request_throughput: float
    latency_ms: Distribution  # completion time of each request, from the start of the batch
    num_preemptions: int | None
    prefix_cache_hits: int | None = None  # prompt tokens taken from the prefix cache
    round: int = 1

    @property
    def name(self) -> str:
        if self.system == "transformers":
            return f"transformers static/{self.setting.dtype}"
        return f"ember {self.setting.label}"


def offline_run(
    system: str, setting: EngineSetting, concurrency: int, latencies: list[float], output_tokens: int,
    duration_s: float, num_preemptions: int | None,
) -> OfflineRun:
    latency_ms = Distribution.of(latencies, 1e3)
    assert latency_ms is not None, "a run has at least one request"
    return OfflineRun(
        system=system,
        setting=setting,
        concurrency=concurrency,
        num_requests=len(latencies),
        output_tokens=output_tokens,
        duration_s=duration_s,
        output_throughput=output_tokens / duration_s,
        request_throughput=len(latencies) / duration_s,
        latency_ms=latency_ms,
        num_preemptions=num_preemptions,
    )
