"""A scripted stand-in for the engine worker, speaking the real wire protocol over a real ROUTER.

Every request gets the same reply tokens, one per step; tests steer it (pause, reject, stop,
restart) to drive the gateway through failures the real engine produces rarely.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from ember_core.tokenizer import Tokenizer, TokenizerSpec
from ember_core.tokenizer.pretokenizers import GPT2
from ember_proto import (
    PROTOCOL_VERSION,
    Abort,
    EngineStats,
    FinishReason,
    GatewayMessage,
    Generate,
    Heartbeat,
    Hello,
    KvEvents,
    KvSync,
    ModelCard,
    Ready,
    RejectCode,
    Rejected,
    RequestDelta,
    StepOutputs,
    TokenLogprob,
    decode_gateway_message,
    encode,
    make_socket,
)

EOS = "<|endoftext|>"
MODEL_STOP_TOKEN_IDS = (256,)  # EOS's id
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer_spec(chat_template: str | None = CHATML, control_tokens: tuple[str, ...] = ()) -> TokenizerSpec:
    """One token per byte (ids 0-255) plus ChatML specials and control_tokens: small, and every
    multi-byte character spans several tokens."""
    specials = {EOS: 256, "<|im_start|>": 257, "<|im_end|>": 258}
    specials.update({token: 259 + index for index, token in enumerate(control_tokens)})
    return TokenizerSpec(
        pattern=GPT2,
        mergeable_ranks={bytes([byte]): byte for byte in range(256)},
        special_tokens=specials,
        eos_token_id=256,
        stop_token_ids=[256, 258],
        chat_template=chat_template,
    )


@dataclass
class _Running:
    gateway: bytes
    generate: Generate
    produced: int = 0


@dataclass
class FakeEngine:
    address: str
    reply_text: str = "Hello, world! ünïcödé €uro"
    tokenizer_spec: TokenizerSpec | None = field(default_factory=byte_tokenizer_spec)
    max_model_len: int = 64
    vocab_size: int = 300
    dtype: str = "bfloat16"  # what its card says it computes in
    step_interval: float = 0.002
    heartbeat_interval: float = 0.2
    protocol_version: int = PROTOCOL_VERSION
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    paused: bool = False  # neither steps nor heartbeats, as a hung engine
    reject_code: RejectCode | None = None  # answer every Generate with this
    draining: bool = False  # said in every heartbeat
    block_size: int = 0  # a prefix cache of this block size, holding cached_hashes (sent as a snapshot)
    cached_hashes: list[bytes] = field(default_factory=list)
    # reported in its stats besides its own running requests: other gateways' work
    backlog_running: int = 0
    backlog_waiting: int = 0
    backlog_prefill_tokens: int = 0
    hellos: int = 0
    received: list[Generate] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        spec = self.tokenizer_spec
        self.tokenizer = Tokenizer.from_spec(spec) if spec is not None else None
        # as a model writes it: a control token's text in the reply is that token
        self.reply_ids = self.tokenizer.encode(self.reply_text, allow_special=True) if self.tokenizer else list(range(1, 40))
        self._running: dict[str, _Running] = {}
        self._gateways: set[bytes] = set()
        self._step = 0
        self._context: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def num_running(self) -> int:
        return len(self._running)

    async def start(self) -> None:
        self._context = zmq.asyncio.Context()
        self._socket = make_socket(self._context, zmq.ROUTER, self.address, bind=True)
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Like a killed engine: the socket goes away with everything in flight."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._socket is not None:
            self._socket.close()
        if self._context is not None:
            self._context.term()
        self._running.clear()
        self._gateways.clear()

    def restart_in_place(self) -> None:
        """As if the engine restarted between two messages: a new id, everything in flight
        forgotten, and a Ready to every gateway (as Hellos would get)."""
        self.engine_id = uuid.uuid4().hex
        self._running.clear()
        for gateway in self._gateways:
            self._send(gateway, Ready(self.protocol_version, self.engine_id, self.card()))

    def card(self) -> ModelCard:
        spec = b"" if self.tokenizer_spec is None else msgspec.msgpack.encode(self.tokenizer_spec)
        return ModelCard("fake-model", self.max_model_len, self.vocab_size, list(MODEL_STOP_TOKEN_IDS), spec, 1700000000,
                         dtype=self.dtype, numerics="fast", cpu_build="avx512bf16")

    async def _run(self) -> None:
        assert self._socket is not None
        loop = asyncio.get_running_loop()
        last_heartbeat = loop.time()
        while True:
            timeout_ms = int(self.step_interval * 1000) if self._running else int(self.heartbeat_interval * 1000)
            if await self._socket.poll(max(timeout_ms, 1)):
                gateway, payload = await self._socket.recv_multipart()
                if not self.paused:
                    self._handle(gateway, decode_gateway_message(payload))
                continue
            if self.paused:
                continue
            if self._running:
                self._run_step()
            elif loop.time() - last_heartbeat >= self.heartbeat_interval:
                last_heartbeat = loop.time()
                self.heartbeat_now()

    def drain(self) -> None:
        """As SIGTERM does: every gateway hears at once that no new request may come."""
        self.draining = True
        self.heartbeat_now()

    def heartbeat_now(self) -> None:
        for gateway in self._gateways:
            self._send(gateway, Heartbeat(self.engine_id, self._stats(), self.draining))

    def _handle(self, gateway: bytes, message: GatewayMessage) -> None:
        if isinstance(message, Hello):
            self.hellos += 1
            if message.protocol_version != self.protocol_version:
                self._send(gateway, Rejected("", RejectCode.INVALID_REQUEST, "protocol version mismatch"))
                return
            self._gateways.add(gateway)
            self._send(gateway, Ready(self.protocol_version, self.engine_id, self.card(), self.block_size))
            if self.block_size:
                self._send(gateway, KvEvents(self.engine_id, 0, self.cached_hashes, snapshot=True))
        elif isinstance(message, KvSync):
            self._send(gateway, KvEvents(self.engine_id, 0, self.cached_hashes, snapshot=True))
        elif isinstance(message, Generate):
            self.received.append(message)
            if self.reject_code is not None:
                self._send(gateway, Rejected(message.request_id, self.reject_code, "rejected by the fake engine"))
            else:
                # a resumed request continues where it was: its reply goes on from there
                self._running[message.request_id] = _Running(gateway, message, len(message.output_token_ids))
        elif isinstance(message, Abort):  # WatchBlocks is ignored: the fake engine has no KV pool to map
            self.aborted.extend(message.request_ids)
            for request_id in message.request_ids:
                self._running.pop(request_id, None)

    def _run_step(self) -> None:
        self._step += 1
        by_gateway: dict[bytes, list[RequestDelta]] = {}
        for request_id, running in list(self._running.items()):
            sampling = running.generate.sampling
            token = self.reply_ids[running.produced % len(self.reply_ids)]
            running.produced += 1
            finish = None
            # as an engine does: the model's EOS ends a reply too, unless ignore_eos
            if token in sampling.stop_token_ids or (token in MODEL_STOP_TOKEN_IDS and not sampling.ignore_eos):
                finish = FinishReason.STOP
            elif running.produced >= sampling.max_tokens:
                finish = FinishReason.LENGTH
            logprobs = []
            if sampling.logprobs is not None:
                top = [(token, -0.25), ((token + 1) % self.vocab_size, -1.5)][: sampling.logprobs]
                logprobs = [TokenLogprob(token, -0.25, top)]
            prompt_logprobs = []
            if sampling.prompt_logprobs is not None and running.produced == 1:
                # prompt token i scores -0.5, its first alternative is the token before it
                prompt_logprobs = [
                    TokenLogprob(t, -0.5, [(t, -0.5), (previous, -2.0)][: sampling.prompt_logprobs])
                    for previous, t in itertools.pairwise(running.generate.prompt_token_ids)
                ]
            prompt_length = len(running.generate.prompt_token_ids)
            delta = RequestDelta(
                request_id=request_id,
                new_token_ids=[token],
                num_prompt_tokens=prompt_length,
                logprobs=logprobs,
                finish_reason=finish,
                prompt_logprobs=prompt_logprobs,
            )
            by_gateway.setdefault(running.gateway, []).append(delta)
            if finish is not None:
                del self._running[request_id]
        for gateway, outputs in by_gateway.items():
            self._send(gateway, StepOutputs(self._step, outputs, self._stats()))

    def _stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self._running) + self.backlog_running,
            num_waiting=self.backlog_waiting,
            num_kv_blocks_used=2 * len(self._running),
            num_kv_blocks_total=100,
            num_preemptions=3,
            preemptions_by_priority={0: 2, 5: 1},
            num_prefix_cache_queries=64,
            num_prefix_cache_hits=48,
            num_queued_prefill_tokens=self.backlog_prefill_tokens,
        )

    def _send(self, gateway: bytes, message: object) -> None:
        assert self._socket is not None
        self._socket.send_multipart([gateway, encode(message)], zmq.NOBLOCK)
