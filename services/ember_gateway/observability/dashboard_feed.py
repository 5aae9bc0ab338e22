"""What GET /dashboard/events sends: every engine's latest block map, queues and steps, each model's
and LoRA adapter's engines and counts, and this gateway's cumulative counters, from which the page
draws rates and latencies over time."""

from __future__ import annotations

import time
from collections import Counter

import msgspec
from prometheus_client.metrics import MetricWrapperBase

from ember_gateway.api.response_bodies import Shape
from ember_gateway.engines.client import EngineClient
from ember_gateway.engines.pool import EnginePool
from ember_gateway.observability.metrics import LABEL, GatewayMetrics


class StepView(Shape):
    prefill_tokens: int
    decode_tokens: int
    batch_size: int
    seconds: float


class EngineView(Shape):
    address: str
    engine_id: str
    model: str
    accepting: bool
    num_blocks: int
    kv_cache_dtype: str  # "" where the engine did not say, as dtype, numerics and cpu_build
    kv_cache_bytes: int
    # A hybrid model's state pool: its slots, those held, its size (0, 0, 0: none).
    state_slots: int
    state_slots_used: int
    state_pool_bytes: int
    dtype: str
    numerics: str
    cpu_build: str
    # Base64 of the engine's BlockMap.holders (proto/README.md): per block, a little-endian unsigned
    # 16-bit value, 0 free, 1 caching a prefix, 2 + i held by running[i]; "" before the first map.
    holders: bytes
    running: list[str]
    waiting: list[str]
    steps: list[StepView]  # the last BLOCK_MAP_STEPS (ember_proto) the gateway heard of, oldest first


class Totals(Shape):
    """Counters since the gateway (prompt and generated tokens, latencies) or the engines (prefix
    cache, preemptions) started, summed over models and engines."""

    prompt_tokens: float
    generation_tokens: float
    time_to_first_token_sum: float
    time_to_first_token_count: float
    inter_token_latency_sum: float
    inter_token_latency_count: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int
    migrations: int
    routing_decisions: dict[str, int]


class ModelView(Shape):
    """A model the engines serve, or a LoRA adapter over one (parent: its base model's name), and
    this gateway's counts of it since it started."""

    name: str
    parent: str | None
    engines: int  # taking requests, with it loaded
    requests: float  # finished with stop or length
    prompt_tokens: float
    generation_tokens: float


class DashboardUpdate(Shape):
    time: float  # unix seconds
    engines: list[EngineView]
    models: list[ModelView]
    totals: Totals


def dashboard_update(pool: EnginePool, metrics: GatewayMetrics) -> DashboardUpdate:
    engines = [_engine_view(client) for client in pool.clients.values() if client.model and client.stats]
    snapshots = pool.snapshots()
    totals = Totals(
        prompt_tokens=_sum(metrics.prompt_tokens, "_total"),
        generation_tokens=_sum(metrics.generation_tokens, "_total"),
        time_to_first_token_sum=_sum(metrics.time_to_first_token, "_sum"),
        time_to_first_token_count=_sum(metrics.time_to_first_token, "_count"),
        inter_token_latency_sum=_sum(metrics.inter_token_latency, "_sum"),
        inter_token_latency_count=_sum(metrics.inter_token_latency, "_count"),
        prefix_cache_queries=sum(engine.stats.num_prefix_cache_queries for engine in snapshots),
        prefix_cache_hits=sum(engine.stats.num_prefix_cache_hits for engine in snapshots),
        preemptions=sum(engine.stats.num_preemptions for engine in snapshots),
        migrations=pool.migrations,
        routing_decisions=dict(pool.routing_decisions),
    )
    return DashboardUpdate(time=time.time(), engines=engines, models=_model_views(pool, metrics), totals=totals)


def _model_views(pool: EnginePool, metrics: GatewayMetrics) -> list[ModelView]:
    engines: Counter[str] = Counter()
    for client in pool.accepting():
        assert client.model is not None
        engines.update([client.model.name, *client.adapters.names])
    requests, prompt_tokens = _by_model(metrics.request_success), _by_model(metrics.prompt_tokens)
    generation_tokens = _by_model(metrics.generation_tokens)
    return [
        ModelView(model.name, model.parent, engines[model.name], requests[model.name], prompt_tokens[model.name],
                  generation_tokens[model.name])
        for model in pool.models()
    ]  # fmt: skip


def _engine_view(client: EngineClient) -> EngineView:
    assert client.model is not None and client.stats is not None
    block_map = client.block_map
    return EngineView(
        address=client.address,
        engine_id=client.model.engine_id,
        model=client.model.name,
        accepting=client.accepting,
        num_blocks=client.stats.num_kv_blocks_total,
        kv_cache_dtype=client.model.card.kv_cache_dtype,
        kv_cache_bytes=client.model.card.kv_cache_bytes,
        state_slots=client.stats.num_state_slots_total,
        state_slots_used=client.stats.num_state_slots_used,
        state_pool_bytes=client.model.card.state_pool_bytes,
        dtype=client.model.card.dtype,
        numerics=client.model.card.numerics,
        cpu_build=client.model.card.cpu_build,
        holders=b"" if block_map is None else block_map.holders,
        running=[] if block_map is None else block_map.running,
        waiting=[] if block_map is None else block_map.waiting,
        steps=[StepView(*msgspec.structs.astuple(step)) for step in client.recent_steps],
    )


def _by_model(metric: MetricWrapperBase) -> Counter[str]:
    """A counter's totals by model_name, its other labels summed."""
    totals: Counter[str] = Counter()
    for family in metric.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                totals[sample.labels[LABEL]] += sample.value
    return totals


def _sum(metric: MetricWrapperBase, suffix: str) -> float:
    """A metric's samples of one kind (`_total`, `_sum`, `_count`) summed over its labels."""
    return sum(sample.value for family in metric.collect() for sample in family.samples if sample.name.endswith(suffix))
