"""Prometheus metrics, one registry per app.

Engine-wide numbers (running, waiting, KV usage, preemptions, prefix cache) are each engine's
latest EngineStats, exported as read with an `engine` label (its address); every gateway connected
to an engine reports the same values. Request metrics count what this gateway served; routing
decisions (by reason) and migrations (requests moved off a lost or draining engine) what this
gateway decided.

ember_request_queue_time_seconds: from a request's arrival at the gateway until the engine step
that produced its first token began. The engine does not report when it scheduled a request, so
the step's start is taken as the moment this gateway received the engine's previous message; the
engine messages a gateway after every step holding its tokens and at least once a second, so this
is close while the gateway has tokens flowing and an underestimate when the request waited behind
steps that carried nothing for this gateway.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ember_gateway.engines.pool import EnginePool
from ember_gateway.engines.router import REASONS

LABEL = "model_name"
ENGINE_LABEL = "engine"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_GAP_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)

class _PoolCollector(Collector):
    def __init__(self, pool: EnginePool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[Metric]:
        labels = [LABEL, ENGINE_LABEL]
        running = GaugeMetricFamily("ember_num_requests_running", "Requests the engine is running.", labels=labels)
        waiting = GaugeMetricFamily("ember_num_requests_waiting", "Requests waiting in the engine.", labels=labels)
        queued_tokens = GaugeMetricFamily(
            "ember_num_queued_prefill_tokens", "Prompt tokens the engine has queued to compute.", labels=labels
        )
        kv_usage = GaugeMetricFamily(
            "ember_kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).", labels=labels
        )
        preemptions = CounterMetricFamily("ember_num_preemptions", "Preemptions since the engine started.", labels=labels)
        preemptions_by_priority = CounterMetricFamily(
            "ember_num_preemptions_by_priority", "Preemptions since the engine started, by the request's priority.",
            labels=[*labels, "priority"],
        )
        prefix_queries = CounterMetricFamily(
            "ember_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", labels=labels
        )
        prefix_hits = CounterMetricFamily(
            "ember_prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed again).", labels=labels
        )
        model_info = GaugeMetricFamily(
            "ember_model_info",
            "1 per engine: the dtype and numerics (exact or fast) its model runs in, its KV cache's dtype and its "
            "CPU kernels' build: what its bits depend on besides the requests.",
            labels=[*labels, "dtype", "numerics", "kv_cache_dtype", "cpu_build"],
        )
        adapters = GaugeMetricFamily(
            "ember_lora_adapter_info",
            "1 per LoRA adapter loaded on an engine, labelled by the adapter's name (its requests' and tokens' "
            "model_name elsewhere) and its parent model.",
            labels=[*labels, "parent"],
        )
        kv_bytes = GaugeMetricFamily("ember_kv_cache_bytes", "Bytes of the engine's KV cache pool.", labels=labels)
        kv_blocks = GaugeMetricFamily("ember_kv_cache_blocks", "Blocks of the engine's KV cache pool.", labels=labels)
        state_usage = GaugeMetricFamily(
            "ember_state_slot_usage_perc",
            "Fraction of a hybrid model's state slots (one per running sequence) in use (0..1); 0 without a state pool.",
            labels=labels,
        )
        state_slots = GaugeMetricFamily(
            "ember_state_slots", "Slots of a hybrid model's state pool (0: the model keeps no recurrent state).", labels=labels
        )
        state_bytes = GaugeMetricFamily("ember_state_pool_bytes", "Bytes of a hybrid model's state pool.", labels=labels)
        speculation = {
            field: CounterMetricFamily(f"ember_spec_decode_{field.removeprefix('spec_')}", help_text, labels=labels)
            for field, help_text in _SPECULATION_COUNTERS.items()
        }
        for engine in self._pool.snapshots():
            key, stats = [engine.model_name, engine.address], engine.stats
            card = engine.card
            model_info.add_metric([*key, card.dtype, card.numerics, card.kv_cache_dtype, card.cpu_build], 1)
            for adapter in engine.adapters:
                adapters.add_metric([adapter, engine.address, engine.model_name], 1)
            kv_bytes.add_metric(key, engine.card.kv_cache_bytes)
            kv_blocks.add_metric(key, stats.num_kv_blocks_total)
            state_usage.add_metric(key, stats.num_state_slots_used / max(stats.num_state_slots_total, 1))
            state_slots.add_metric(key, stats.num_state_slots_total)
            state_bytes.add_metric(key, card.state_pool_bytes)
            for field, family in speculation.items():
                family.add_metric(key, getattr(stats, field))
            running.add_metric(key, stats.num_running)
            waiting.add_metric(key, stats.num_waiting)
            queued_tokens.add_metric(key, stats.num_queued_prefill_tokens)
            kv_usage.add_metric(key, stats.num_kv_blocks_used / max(stats.num_kv_blocks_total, 1))
            preemptions.add_metric(key, stats.num_preemptions)
            for priority, count in sorted(stats.preemptions_by_priority.items()):
                preemptions_by_priority.add_metric([*key, str(priority)], count)
            prefix_queries.add_metric(key, stats.num_prefix_cache_queries)
            prefix_hits.add_metric(key, stats.num_prefix_cache_hits)
        routing = CounterMetricFamily(
            "ember_routing_decisions", "Requests routed to an engine, by the reason it won.", labels=["reason"]
        )
        for reason in REASONS:
            routing.add_metric([reason], self._pool.routing_decisions[reason])
        migrations = CounterMetricFamily(
            "ember_request_migrations", "Engine requests moved off a lost, draining or refusing engine to another."
        )
        migrations.add_metric([], self._pool.migrations)
        expert_tokens = CounterMetricFamily(
            "ember_moe_expert_tokens",
            "Tokens a mixture-of-experts model routed to each expert of each layer (sent once a second).",
            labels=[*labels, "layer", "expert"],
        )
        for engine in self._pool.snapshots():
            for layer, counts in enumerate(engine.stats.expert_tokens):
                for expert, count in enumerate(counts):
                    expert_tokens.add_metric([engine.model_name, engine.address, str(layer), str(expert)], count)
        yield from (
            running, waiting, queued_tokens, kv_usage, kv_bytes, kv_blocks, state_usage, state_slots, state_bytes, preemptions, preemptions_by_priority, prefix_queries, prefix_hits,
            routing, migrations, expert_tokens, model_info, adapters, *speculation.values(),
        )


_SPECULATION_COUNTERS = {  # EngineStats field -> help; the metrics vLLM's spec-decode counters name
    "spec_num_drafts": "Sequence-steps that verified speculative draft tokens.",
    "spec_num_draft_tokens": "Speculative draft tokens proposed and verified.",
    "spec_num_accepted_tokens": "Speculative draft tokens accepted.",
    "spec_num_emitted_tokens": "Tokens the verifying steps appended: accepted drafts plus the token after them.",
}


class GatewayMetrics:
    def __init__(self, pool: EnginePool) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_PoolCollector(pool))
        self.prompt_tokens = Counter(
            "ember_prompt_tokens", "Prompt tokens of engine requests that produced a token.", [LABEL],
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "ember_generation_tokens", "Tokens generated by the engine.", [LABEL], registry=self.registry
        )
        self.request_success = Counter(
            "ember_request_success",
            "Engine requests that finished with stop or length and reached their client.",
            [LABEL, "finished_reason"],
            registry=self.registry,
        )
        self.request_errors = Counter(
            "ember_request_errors",
            "HTTP requests answered with an error (/health's 503 aside), by status; an error a stream or a "
            "started JSON body ends with counts with its status too.",
            ["status"],
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "ember_time_to_first_token_seconds", "Arrival at the gateway to first token.", [LABEL],
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "ember_inter_token_latency_seconds", "Time between consecutive token deltas of a request.", [LABEL],
            buckets=_TOKEN_GAP_BUCKETS, registry=self.registry,
        )
        self.e2e_request_latency = Histogram(
            "ember_e2e_request_latency_seconds", "Arrival at the gateway to the request's last token.", [LABEL],
            buckets=_REQUEST_BUCKETS, registry=self.registry,
        )
        self.request_queue_time = Histogram(
            "ember_request_queue_time_seconds", "Arrival until the engine step that produced the first token began.",
            [LABEL], buckets=_REQUEST_BUCKETS, registry=self.registry,
        )

    def count_error(self, status: int) -> None:
        self.request_errors.labels(str(status)).inc()
