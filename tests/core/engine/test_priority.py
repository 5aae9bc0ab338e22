"""Request priority in the engine: refused under fcfs (as vLLM), honoured under the priority policy."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember_core import LLM, SamplingParams
from ember_core.engine.engine import RequestRejected


def test_fcfs_refuses_a_non_zero_priority(smollm2_gguf_path: Path) -> None:
    llm = LLM(str(smollm2_gguf_path), dtype="float32", num_blocks=16)
    with pytest.raises(RequestRejected, match="priority 3 needs the engine's --scheduling-policy priority"):
        llm.generate("Hello", SamplingParams(max_tokens=2, priority=3))
    assert llm.generate("Hello", SamplingParams(max_tokens=2, priority=0))[0].finish_reason == "length"


def test_the_priority_policy_runs_the_lower_priority_first(smollm2_gguf_path: Path) -> None:
    llm = LLM(str(smollm2_gguf_path), dtype="float32", num_blocks=32, max_num_seqs=1, scheduling_policy="priority")
    engine = llm.engine
    for request_id, priority in (("background", 5), ("urgent", -1)):
        engine.add_request(request_id, [1, 2, 3, 4], SamplingParams(max_tokens=3, temperature=0, priority=priority))
    finished = []
    while engine.has_unfinished():
        finished += [delta.request_id for delta in engine.step() if delta.finish_reason is not None]
    assert finished == ["urgent", "background"]
