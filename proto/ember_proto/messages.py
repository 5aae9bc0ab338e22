"""Wire messages between gateways and the engine: msgspec Structs in two tagged unions.

Every message is a MessagePack array whose first element is the type tag (the class name).
"""

from __future__ import annotations

from enum import IntEnum

import msgspec

# 2: Generate.output_token_ids; 3: TokenLogprob carries its token id; 4: KV cache events
# (KvEvents, KvSync), Ready.block_size, Heartbeat.draining; 5: SamplingOptions.structured_outputs;
# 6: embeddings (Generate.embed, RequestDelta.embedding, Ready.task, the ModelCard's embedding sizes);
# 7: Generate.traceparent, and the KV block map for dashboards (WatchBlocks, BlockMap); 8: LoRA
# adapters (Generate.adapter, LoadAdapter, UnloadAdapter, AdapterDone, Adapters, Ready.adapters)
PROTOCOL_VERSION = 8
PROBE_ID_PREFIX = "probe-"  # a Hello's gateway_id from a health probe (ember_engine.probe)


class _Message(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class FinishReason(IntEnum):
    """Why a request ended: one enum for the engine, the wire and the gateway."""

    STOP = 1  # EOS or a stop token id
    LENGTH = 2  # max_tokens, the model context, or a KV pool too small for the sequence
    ABORT = 3

    @property
    def label(self) -> str:
        return self.name.lower()


class RejectCode(IntEnum):
    INVALID_REQUEST = 400  # the request can never run: bad ids, too long, bad params
    INTERNAL = 500  # the engine failed while running the request
    UNAVAILABLE = 503  # the engine is draining or does not know this gateway (send Hello again)


class StructuredOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, kw_only=True):
    """One constraint on a request's output (vLLM's StructuredOutputsParams): exactly one field set."""

    json: str | None = None  # a JSON schema, as JSON text
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # one of these strings, exactly
    grammar: str | None = None  # Lark, or GBNF (llama.cpp's), as llguidance reads them
    # JSON (json, json_object) may put a line break and indentation between tokens; by default it
    # is compact: at most one space between tokens.
    any_whitespace: bool = False


class SamplingOptions(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_p: float = 0.0
    structured_outputs: StructuredOutputs | None = None
    priority: int = 0  # lower runs first under the engine's priority scheduling policy


class EmbedOptions(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A Generate that asks for the prompt's pooled embedding, not tokens (its sampling: max_tokens 0)."""

    dimensions: int | None = None  # truncate to this many values (Matryoshka), re-normalised


# gateway -> engine


class Hello(_Message):
    protocol_version: int
    gateway_id: str


class Generate(_Message):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    arrival_time: float  # time.time() at the gateway
    deadline: float | None = None  # time.time() after which the engine aborts the request
    # Tokens the request generated on an engine that was lost; it continues after them (a gateway
    # resuming its requests on a restarted engine).
    output_token_ids: list[int] = []
    embed: EmbedOptions | None = None
    # W3C trace context of the gateway's span (OpenTelemetry tracing on); the engine's spans are its children
    traceparent: str | None = None
    adapter: str = ""  # the LoRA adapter the request runs with; "": the base model


class Abort(_Message):
    request_ids: list[str]


class KvSync(_Message):
    """Asks for a KvEvents snapshot: the gateway missed a batch (a gap in the sequence numbers)."""


class WatchBlocks(_Message):
    """Asks for a BlockMap a few times a second for the next `seconds` (a dashboard is open); the
    gateway sends it again before they run out while a viewer stays."""

    seconds: float


class LoadAdapter(_Message):
    """Load a PEFT LoRA checkpoint (a directory on the engine's host, or a Hub repo id) as `name`;
    answered with an AdapterDone, and every gateway is sent the engine's Adapters."""

    request_id: str
    name: str
    path: str


class UnloadAdapter(_Message):
    request_id: str
    name: str


GatewayMessage = Hello | Generate | Abort | KvSync | WatchBlocks | LoadAdapter | UnloadAdapter


# engine -> gateway


class ModelCard(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    model_id: str
    max_model_len: int
    vocab_size: int
    stop_token_ids: list[int]
    tokenizer_spec: bytes = b""  # a MessagePack-encoded ember_core.tokenizer.TokenizerSpec; empty: none
    created: int = 0
    hidden_size: int = 0  # the values of an embedding
    # The sizes an embedding may be truncated to (Matryoshka): [] any up to hidden_size; None: none.
    matryoshka_dimensions: list[int] | None = None
    dtype: str = ""  # of the activations: "float32", "bfloat16", ...; empty: the engine did not say
    numerics: str = ""  # "exact" or "fast" (ember_core/numerics.py); empty: the engine did not say
    # The KV cache's dtype ("bfloat16", "int8", "fp8_e4m3", ...), which keys its block hashes, and its
    # size; empty / 0: the engine did not say.
    kv_cache_dtype: str = ""
    kv_cache_bytes: int = 0
    # The CPU kernels' build ("avx2", "avx512", "avx512bf16", "amx"; "torch" without them): bfloat16
    # bits differ between builds. Empty: not a CPU, or the engine did not say.
    cpu_build: str = ""
    state_pool_bytes: int = 0  # a hybrid model's recurrent states beside the KV cache; 0: none


class Ready(_Message):
    protocol_version: int
    engine_id: str  # new on every engine start: a gateway that sees it change lost its in-flight requests
    model: ModelCard
    block_size: int = 0  # of the prefix cache, whose hashes KvEvents carry; 0: no prefix cache
    step_token_budget: int = 0  # tokens one step computes at most (max_num_batched_tokens); 0: unknown
    task: str = "generate"  # "embed": the engine refuses every Generate but an embedding one
    adapters: list[str] = []  # the LoRA adapters loaded, which requests name as their model
    max_loras: int = 0  # adapters it can hold; 0: LoRA is off


class AdapterDone(_Message):
    """The answer to a LoadAdapter or UnloadAdapter: code 200, or 400 (a load that cannot serve this
    model, nothing loaded), 404 (no such adapter), 409 (in use by requests in flight)."""

    request_id: str
    code: int
    message: str = ""


class Adapters(_Message):
    """The engine's adapters, to every gateway, after each load and unload."""

    engine_id: str
    names: list[str]


class EngineStats(msgspec.Struct, array_like=True, gc=False):
    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    num_preemptions: int
    # Prompt tokens looked up in the prefix cache since the engine started, and those found there.
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0
    # Prompt tokens queued to compute (the scheduler's estimate), what the gateways route by.
    num_queued_prefill_tokens: int = 0
    # A mixture of experts' load: per decoder layer, the tokens routed to each of its experts since the
    # engine started ([] for a dense layer). Sent to a gateway at most once a second; [] in between.
    expert_tokens: list[list[int]] = []
    # Preemptions since the engine started, by the preempted request's priority.
    preemptions_by_priority: dict[int, int] = {}
    # Speculative decoding since the engine started (vLLM's counters): verifications (sequence-steps
    # carrying drafts), draft tokens, the drafts accepted, and the tokens those steps appended.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_emitted_tokens: int = 0
    # A hybrid model's state pool: slots held by running sequences, and all of them (0: no pool).
    num_state_slots_used: int = 0
    num_state_slots_total: int = 0


class TokenLogprob(msgspec.Struct, array_like=True, gc=False):
    """A token, its logprob and the most likely tokens at its position as (token id, logprob), most
    likely first: one shape from the sampler to the SSE writer. The sampler gives every token it
    draws in this shape, the logprob None where the request asked for none (never so on the wire)."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = []


class RequestDelta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    num_prompt_tokens: int
    logprobs: list[TokenLogprob] = []
    finish_reason: FinishReason | None = None
    prompt_logprobs: list[TokenLogprob] = []  # of prompt tokens 1, 2, ..., with the first new token
    embedding: bytes = b""  # an embedding request's, with its finish: float32 values, little-endian


class StepOutputs(_Message):
    step: int
    outputs: list[RequestDelta]
    stats: EngineStats


class Rejected(_Message):
    request_id: str
    code: RejectCode
    message: str


class Heartbeat(_Message):
    engine_id: str
    stats: EngineStats
    draining: bool = False  # shutting down: no new requests; sent at once when the drain begins


class KvEvents(_Message):
    """Prefix blocks the engine's cache registered (stored) and evicted (removed) since the last
    batch, as ember_core.cache.block_hash hashes; sent to every gateway after each step that changed
    the cache. `sequence` counts batches from 1; a snapshot (after Ready, or asked for with KvSync)
    lists every hash held, carries the sequence number of the last batch it includes, and replaces
    what the gateway knew."""

    engine_id: str
    sequence: int
    stored: list[bytes]
    removed: list[bytes] = []
    snapshot: bool = False


class StepSample(msgspec.Struct, array_like=True, gc=False):
    """One engine step's composition: prompt tokens computed, the other tokens (decode, drafts),
    sequences in the batch, and the step's wall time."""

    num_prefill_tokens: int
    num_decode_tokens: int
    batch_size: int
    seconds: float


# BlockMap.holders: a block no sequence holds, empty or caching a prefix; 2 + i: held by requests[i].
BLOCK_FREE = 0
BLOCK_CACHED = 1
BLOCK_HELD = 2
BLOCK_MAP_HZ = 4  # the most BlockMaps an engine sends a second
BLOCK_MAP_STEPS = 64  # the most StepSamples a BlockMap carries


class BlockMap(_Message):
    """The KV pool block by block, the queues and the steps since the last map, sent to gateways
    that asked with WatchBlocks, at most BLOCK_MAP_HZ times a second."""

    engine_id: str
    holders: bytes  # one unsigned 16-bit little-endian value per block: BLOCK_FREE, BLOCK_CACHED, BLOCK_HELD + i
    running: list[str]  # request ids, oldest first; a held block names one of its holders
    waiting: list[str]  # request ids, next first
    steps: list[StepSample]  # oldest first, at most the last BLOCK_MAP_STEPS


EngineMessage = Ready | StepOutputs | Rejected | Heartbeat | KvEvents | BlockMap | AdapterDone | Adapters

_encoder = msgspec.msgpack.Encoder()
_gateway_decoder = msgspec.msgpack.Decoder(GatewayMessage)
_engine_decoder = msgspec.msgpack.Decoder(EngineMessage)


def encode(message: _Message) -> bytes:
    return _encoder.encode(message)


def decode_gateway_message(data: bytes) -> GatewayMessage:
    """Raises msgspec.DecodeError / ValidationError on anything malformed or unknown."""
    return _gateway_decoder.decode(data)


def decode_engine_message(data: bytes) -> EngineMessage:
    return _engine_decoder.decode(data)
