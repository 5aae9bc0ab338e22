"""`python -m ember_bench.priority_ttft`: request priority on a saturated engine, in process.

Long low-priority streams fill the engine (more than --max-num-seqs, so some wait), then a burst
arrives at one moment: short high-priority requests and as many short low-priority ones. Under
`--scheduling-policy priority` the high ones should start at once (preempting low-priority streams),
the low ones wait their turn. Prints the time to first token (p50) of each group of the burst and
their ratio, on the default model unless --model says otherwise.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

from ember_core.config import EngineConfig
from ember_core.engine.engine import Engine
from ember_core.sampling_params import SamplingParams

HIGH, LOW = -1, 1  # the burst's priorities; the filling streams run at LOW


@dataclass(frozen=True)
class PriorityRun:
    high_ttft_p50_s: float
    low_ttft_p50_s: float
    preemptions: int

    @property
    def ratio(self) -> float:
        return self.high_ttft_p50_s / self.low_ttft_p50_s


def run(model: str, streams: int, burst: int, stream_tokens: int, burst_tokens: int, warm_steps: int,
        max_num_seqs: int) -> PriorityRun:
    engine = Engine(EngineConfig(model=model, dtype="float32", max_num_seqs=max_num_seqs, scheduling_policy="priority",
                                 enable_prefix_caching=False))
    for index in range(streams):
        prompt = [10 + index % 50] * 32
        engine.add_request(f"stream-{index}", prompt, SamplingParams(max_tokens=stream_tokens, ignore_eos=True,
                                                                     temperature=0, priority=LOW))
    for _ in range(warm_steps):  # the streams are decoding: the engine is full
        engine.step()
    arrived = time.monotonic()
    for index in range(burst):
        for group, priority in (("high", HIGH), ("low", LOW)):
            engine.add_request(f"{group}-{index}", [20 + index] * 16,
                               SamplingParams(max_tokens=burst_tokens, ignore_eos=True, temperature=0, priority=priority),
                               arrival_time=arrived)
    first_token: dict[str, float] = {}
    while any(f"{group}-{index}" not in first_token for group in ("high", "low") for index in range(burst)):
        for delta in engine.step():
            if delta.new_token_ids and not delta.request_id.startswith("stream") and delta.request_id not in first_token:
                first_token[delta.request_id] = time.monotonic() - arrived
    engine.abort([f"stream-{index}" for index in range(streams)])
    while engine.has_unfinished():
        engine.step()
    ttft = {group: statistics.median(t for rid, t in first_token.items() if rid.startswith(group)) for group in ("high", "low")}
    return PriorityRun(ttft["high"], ttft["low"], engine.stats().num_preemptions)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ember_bench.priority_ttft", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=EngineConfig.model)
    parser.add_argument("--streams", type=int, default=80, help="long low-priority streams filling the engine")
    parser.add_argument("--burst", type=int, default=8, help="short requests of each priority arriving together")
    parser.add_argument("--stream-tokens", type=int, default=256)
    parser.add_argument("--burst-tokens", type=int, default=8)
    parser.add_argument("--warm-steps", type=int, default=40, help="steps the streams run before the burst")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    args = parser.parse_args(argv)
    result = run(args.model, args.streams, args.burst, args.stream_tokens, args.burst_tokens, args.warm_steps,
                 args.max_num_seqs)
    print(f"{args.streams} low-priority streams, then {args.burst} high- and {args.burst} low-priority requests at once: "
          f"TTFT p50 high {result.high_ttft_p50_s:.3f} s, low {result.low_ttft_p50_s:.3f} s, ratio {result.ratio:.2f}; "
          f"{result.preemptions} preemptions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
