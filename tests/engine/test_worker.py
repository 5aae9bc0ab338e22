"""The engine worker over its real ROUTER socket, driven by raw DEALER clients."""

from __future__ import annotations

import array
import itertools
import signal
import threading
import time
import uuid

import msgspec
import pytest
import zmq

from ember_core import SamplingParams
from ember_proto import (
    BLOCK_HELD,
    PROTOCOL_VERSION,
    Abort,
    BlockMap,
    EmbedOptions,
    FinishReason,
    Generate,
    Heartbeat,
    Hello,
    Ready,
    RejectCode,
    Rejected,
    SamplingOptions,
    StepOutputs,
    WatchBlocks,
    decode_engine_message,
    encode,
    make_socket,
)
from tests.conftest import token_prompts
from tests.processes import engine_argv, free_port, spawned, stop_process, wait_until

NUM_BLOCKS = 64


class Client:
    """A bare gateway: one DEALER, Hello, and helpers to collect a request's deltas."""

    def __init__(self, context: zmq.Context, address: str, hello: bool = True) -> None:
        self.gateway_id = f"gw-test-{uuid.uuid4().hex[:8]}"
        self.socket = make_socket(context, zmq.DEALER, address, bind=False, identity=self.gateway_id.encode())
        self.ready: Ready | None = None
        if hello:
            self.send(Hello(PROTOCOL_VERSION, self.gateway_id))
            self.ready = self.expect(Ready, timeout=60)

    def send(self, message) -> None:
        self.socket.send(encode(message))

    def recv(self, timeout: float):
        if not self.socket.poll(int(timeout * 1000)):
            raise TimeoutError("no message from the engine")
        return decode_engine_message(self.socket.recv())

    def expect(self, kind, timeout: float = 10):
        deadline = time.monotonic() + timeout
        while True:
            message = self.recv(max(0.01, deadline - time.monotonic()))
            if isinstance(message, kind):
                return message

    def generate(self, request_id: str, prompt: list[int], **sampling) -> None:
        self.send(Generate(request_id, prompt, SamplingOptions(**sampling), time.time()))

    def collect(self, request_ids: set[str], timeout: float = 30) -> tuple[dict, list[StepOutputs]]:
        """Tokens and finish reason of each request, plus every StepOutputs seen."""
        results = {r: {"tokens": [], "finish": None, "rejected": None} for r in request_ids}
        steps: list[StepOutputs] = []
        pending = set(request_ids)
        deadline = time.monotonic() + timeout
        while pending:
            message = self.recv(max(0.01, deadline - time.monotonic()))
            if isinstance(message, StepOutputs):
                steps.append(message)
                for delta in message.outputs:
                    results[delta.request_id]["tokens"] += delta.new_token_ids
                    if delta.finish_reason is not None:
                        results[delta.request_id]["finish"] = delta.finish_reason
                        pending.discard(delta.request_id)
            elif isinstance(message, Rejected) and message.request_id in pending:
                results[message.request_id]["rejected"] = message
                pending.discard(message.request_id)
        return results, steps

    def close(self) -> None:
        self.socket.close()


@pytest.fixture(scope="module")
def engine(gpt2_dir, tmp_path_factory):
    address = f"tcp://127.0.0.1:{free_port()}"
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    argv = engine_argv(gpt2_dir, address, "--num-blocks", str(NUM_BLOCKS), "--block-size", "4", "--heartbeat-interval", "0.3")
    with spawned(argv, log) as process:
        yield address, process


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def test_ready_carries_the_model_card(engine, context) -> None:
    client = Client(context, engine[0])
    card = client.ready.model
    assert card.vocab_size == 384 and card.max_model_len == 256
    assert card.tokenizer_spec == b""  # this checkpoint has no tokenizer files
    assert card.stop_token_ids == [0]
    assert (card.hidden_size, card.matryoshka_dimensions, client.ready.task) == (64, None, "generate")


def test_tokens_equal_the_offline_engine(engine, context, gpt2_llm) -> None:
    prompts = token_prompts(4, seed=41)
    client = Client(context, engine[0])
    for i, prompt in enumerate(prompts):
        client.generate(f"r{i}", prompt, max_tokens=10, temperature=0, ignore_eos=True)
    results, _ = client.collect({f"r{i}" for i in range(len(prompts))})
    offline = gpt2_llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    for i, out in enumerate(offline):
        assert results[f"r{i}"]["tokens"] == out.token_ids
        assert results[f"r{i}"]["finish"] is FinishReason.LENGTH


def test_malformed_messages_are_dropped_and_the_engine_keeps_serving(engine, context) -> None:
    client = Client(context, engine[0])
    client.socket.send(b"\x00garbage")
    client.socket.send(msgspec.msgpack.encode(["Explode", 1, 2]))
    client.socket.send(msgspec.msgpack.encode(["Generate", "x", "not a list"]))
    client.socket.send_multipart([b"a", b"b"])
    client.send(Abort(["nobody"]))
    client.generate("ok", [1, 2, 3], max_tokens=3, temperature=0)
    results, _ = client.collect({"ok"})
    assert len(results["ok"]["tokens"]) == 3
    assert engine[1].poll() is None


@pytest.mark.parametrize(
    "prompt, sampling, fragment",
    [
        ([1, 2, 384], {}, "outside the vocabulary"),
        ([], {}, "empty"),
        ([1] * 250, {"max_tokens": 10}, "exceeds the model context"),
        ([1, 2], {"top_p": -0.1}, "top_p"),
        ([1, 2], {"max_tokens": -1}, "max_tokens"),
        ([1] * 255, {"max_tokens": 1, "min_tokens": 0}, None),
    ],
)
def test_bad_requests_are_rejected_with_400(engine, context, prompt, sampling, fragment) -> None:
    client = Client(context, engine[0])
    client.generate("bad", prompt, **sampling)
    results, _ = client.collect({"bad"})
    rejected = results["bad"]["rejected"]
    if fragment is None:
        assert rejected is None and results["bad"]["finish"] is not None
    else:
        assert rejected.code is RejectCode.INVALID_REQUEST and fragment in rejected.message


def test_a_gateway_that_never_said_hello_gets_503(engine, context) -> None:
    client = Client(context, engine[0], hello=False)
    client.generate("r", [1, 2, 3])
    rejected = client.expect(Rejected, timeout=10)
    assert rejected.code is RejectCode.UNAVAILABLE and rejected.request_id == "r"


def test_abort_frees_the_blocks_within_a_step(engine, context) -> None:
    client = Client(context, engine[0])
    client.generate("long", [1, 2, 3, 4, 5], max_tokens=200, temperature=0, ignore_eos=True)
    client.expect(StepOutputs)
    # The probe is read with or after the Abort and gets its first token in the first step after
    # it is read, so the abort must have landed by then: in the same step or an earlier one.
    client.send(Abort(["long"]))
    client.generate("probe", [1, 2, 3], max_tokens=2, temperature=0, ignore_eos=True)
    results, steps = client.collect({"long", "probe"})
    assert results["long"]["finish"] is FinishReason.ABORT
    abort_step = next(s.step for s in steps for d in s.outputs if d.request_id == "long" and d.finish_reason)
    probe_step = next(s.step for s in steps for d in s.outputs if d.request_id == "probe")
    assert abort_step <= probe_step
    assert steps[-1].stats.num_kv_blocks_used == 0 and steps[-1].stats.num_running == 0


def test_deadline_aborts_the_request(engine, context) -> None:
    # A deadline that has passed by the time the engine reads the request: how long 240 tokens of
    # the test model take depends on the machine, so a deadline during the run would be a race.
    client = Client(context, engine[0])
    sampling = SamplingOptions(max_tokens=240, ignore_eos=True)
    client.send(Generate("late", [1, 2, 3], sampling, time.time(), time.time() - 1))
    client.send(Generate("in time", [1, 2, 3], sampling, time.time(), time.time() + 600))
    results, steps = client.collect({"late", "in time"})
    assert results["late"]["finish"] is FinishReason.ABORT and results["late"]["tokens"] == []
    assert results["in time"]["finish"] is FinishReason.LENGTH and len(results["in time"]["tokens"]) == 240
    assert steps[-1].stats.num_kv_blocks_used == 0


def test_two_gateways_get_only_their_own_deltas_one_message_per_step(engine, context) -> None:
    a, b = Client(context, engine[0]), Client(context, engine[0])
    for i in range(3):
        a.generate(f"a{i}", [1, 2, 3 + i], max_tokens=8, temperature=0, ignore_eos=True)
        b.generate(f"b{i}", [4, 5, 6 + i], max_tokens=8, temperature=0, ignore_eos=True)
    for client, prefix in ((a, "a"), (b, "b")):
        results, steps = client.collect({f"{prefix}{i}" for i in range(3)})
        assert all(len(r["tokens"]) == 8 for r in results.values())
        assert all(d.request_id.startswith(prefix) for s in steps for d in s.outputs)
        step_numbers = [s.step for s in steps]
        assert len(step_numbers) == len(set(step_numbers))


def test_an_embedding_request_gets_the_offline_engines_vector_beside_generation(engine, context, gpt2_llm) -> None:
    prompts = token_prompts(3, seed=43)
    client = Client(context, engine[0])
    client.generate("gen", prompts[0], max_tokens=6, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        client.send(Generate(f"emb{i}", prompt, SamplingOptions(max_tokens=0), time.time(), embed=EmbedOptions()))
    results, steps = client.collect({"gen", "emb0", "emb1", "emb2"})
    deltas = {d.request_id: d for s in steps for d in s.outputs if d.request_id.startswith("emb")}
    offline = gpt2_llm.embed(prompts)
    for i, out in enumerate(offline):
        assert (results[f"emb{i}"]["finish"], results[f"emb{i}"]["tokens"]) == (FinishReason.STOP, [])
        assert array.array("f", deltas[f"emb{i}"].embedding).tolist() == pytest.approx(out.embedding, abs=1e-6)
    assert len(results["gen"]["tokens"]) == 6


def test_an_idle_engine_sends_heartbeats(engine, context) -> None:
    client = Client(context, engine[0])
    heartbeat = client.expect(Heartbeat, timeout=5)
    assert heartbeat.engine_id == client.ready.engine_id
    assert heartbeat.stats.num_kv_blocks_total == NUM_BLOCKS


def test_sigterm_stops_admitting_aborts_in_flight_after_the_timeout_and_exits_0(gpt2_dir, tmp_path, context) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    argv = engine_argv(gpt2_dir, address, "--num-blocks", "64", "--shutdown-timeout", "0.5")
    with spawned(argv, tmp_path / "engine.log") as process:
        client = Client(context, address)
        client.generate("inflight", [1, 2, 3], max_tokens=250, temperature=0, ignore_eos=True)
        client.expect(StepOutputs)
        process.send_signal(signal.SIGTERM)
        client.generate("new", [1, 2, 3], max_tokens=2)
        results, _ = client.collect({"inflight", "new"})
        assert results["new"]["rejected"].code is RejectCode.UNAVAILABLE
        assert results["inflight"]["finish"] in (FinishReason.ABORT, FinishReason.LENGTH)
        assert stop_process(process) == 0


def test_a_gateway_that_goes_away_has_its_requests_aborted(gpt2_dir, tmp_path, context) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    log = tmp_path / "engine.log"
    argv = engine_argv(gpt2_dir, address, "--num-blocks", "256", "--block-size", "4", "--heartbeat-interval", "0.2")
    with spawned(argv, log):
        watcher = Client(context, address)
        gone = Client(context, address)
        orphans = {f"orphan{i}" for i in range(4)}
        for i in range(4):
            gone.generate(f"orphan{i}", [1, 2, 3 + i], max_tokens=250, temperature=0, ignore_eos=True)
        # every request running: on a busy machine the first step may come before the last Generates
        started: set[str] = set()
        while started != orphans:
            started |= {delta.request_id for delta in gone.expect(StepOutputs).outputs}
        gone.socket.close(linger=0)  # as a killed gateway: no Abort is ever sent
        wait_until(lambda: "went away; aborted its 4 requests in flight" in log.read_text(), 30, "the abort")
        # Heartbeats sent before the abort may still be queued for the watcher: read on to a fresh one.
        wait_until(lambda: watcher.expect(Heartbeat, timeout=5).stats.num_running == 0, 10, "a heartbeat after the abort")
        # The engine keeps serving the gateways still there.
        watcher.generate("after", [1, 2, 3], max_tokens=3, temperature=0)
        results, _ = watcher.collect({"after"})
        assert len(results["after"]["tokens"]) == 3


def test_heartbeats_keep_flowing_during_a_step_longer_than_the_interval(gpt2_dir, context, monkeypatch) -> None:
    """A long step (a long prompt's chunk on a slow CPU) must not look like a dead engine to the
    gateways; the step's length is played by a sleep, which releases the GIL as torch's kernels do."""
    from ember_core import LLM
    from ember_engine.worker import EngineWorker, WorkerOptions

    engine = LLM(str(gpt2_dir), device="cpu", dtype="float32", num_blocks=64, block_size=4).engine
    real_step = engine.step

    def slow_step():
        time.sleep(1.2)
        return real_step()

    monkeypatch.setattr(engine, "step", slow_step)
    address = f"tcp://127.0.0.1:{free_port()}"
    worker = EngineWorker(engine, "tiny", WorkerOptions(address, heartbeat_interval=0.2))
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        client = Client(context, address)
        client.generate("slow", [1, 2, 3], max_tokens=2, temperature=0, ignore_eos=True)
        arrivals, done = [time.monotonic()], False
        while not done:
            message = client.recv(timeout=10)
            arrivals.append(time.monotonic())
            done = isinstance(message, StepOutputs) and message.outputs[-1].finish_reason is not None
        gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
        assert arrivals[-1] - arrivals[0] > 2.4  # two slow steps
        assert max(gaps) < 0.8, gaps
    finally:
        worker.request_shutdown()
        thread.join(timeout=30)
    assert not thread.is_alive()


def test_block_maps_go_only_to_a_gateway_watching_and_show_a_request_holding_blocks(engine, context) -> None:
    watcher, bystander = Client(context, engine[0]), Client(context, engine[0])
    # The request first, then the watch: the engine's first map, sent as soon as one watches, finds it
    # running. A watch first could put its first map before the request arrives, and the next one a
    # quarter second later after the request's 200 tokens (a few ms a step) are done.
    watcher.generate("held", list(range(1, 30)), max_tokens=200, temperature=0, ignore_eos=True)
    watcher.send(WatchBlocks(30))
    block_maps = []
    while not any("held" in m.running for m in block_maps):
        block_maps.append(watcher.expect(BlockMap, timeout=10))
    holding = block_maps[-1]
    index = holding.running.index("held")
    holders = array.array("H", holding.holders)
    assert len(holders) == NUM_BLOCKS and holding.engine_id == watcher.ready.engine_id
    assert holders.count(BLOCK_HELD + index) >= 29 // 4  # block size 4: the prompt's blocks at least
    watcher.collect({"held"})
    idle = watcher.expect(BlockMap, timeout=10)
    block_maps.append(idle)
    while idle.running:
        idle = watcher.expect(BlockMap, timeout=10)
        block_maps.append(idle)
    assert all(value < BLOCK_HELD for value in array.array("H", idle.holders))
    samples = [sample for m in block_maps for sample in m.steps]
    assert any(s.num_prefill_tokens for s in samples) and any(s.num_decode_tokens for s in samples)
    assert all(s.batch_size >= 1 and s.seconds > 0 for s in samples)
    with pytest.raises(TimeoutError):
        bystander.expect(BlockMap, timeout=1)
