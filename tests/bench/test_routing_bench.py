"""The multi-tenant conversation workload and `ember bench routing` on the test model."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from ember_bench.cli import main as bench_main
from ember_bench.conversations import Conversation, ConversationWorkload, load_conversations, make_conversations
from ember_core.tokenizer import tokenizer_from_gguf
from tests.gateway.tiny_tokenizer import write_model_with_tokenizer

SHIPPED = Path(__file__).parents[2] / "services/ember_bench/workloads/conversations_smollm2.json"


def test_conversations_share_their_tenant_s_context_and_carry_the_answers(smollm2_reader) -> None:
    tokenizer = tokenizer_from_gguf(smollm2_reader)
    workload = make_conversations(tokenizer, tenants=3, users=2, turns=2, context_tokens=200, max_tokens=8, seed=1)
    assert len(workload.contexts) == 3 and len(workload.conversations) == 6
    assert all(len(tokenizer.encode_prompt(context)) >= 200 for context in workload.contexts)
    assert sorted(c.tenant for c in workload.conversations) == [0, 0, 1, 1, 2, 2]
    conversation = workload.conversations[0]
    first, second = workload.prompt(conversation, []), workload.prompt(conversation, [" an answer"])
    assert first.startswith(workload.contexts[conversation.tenant]) and first.endswith("Assistant:")
    assert second.startswith(first) and f"Assistant: an answer\nUser: {conversation.questions[1]}" in second


def test_the_shipped_conversations_load() -> None:
    workload = load_conversations(SHIPPED)
    assert (len(workload.contexts), len(workload.conversations)) == (8, 32)
    assert {len(c.questions) for c in workload.conversations} == {3}


def test_routing_bench_runs_each_mode_on_a_fresh_server(gpt2_dir: Path, tmp_path: Path, capsys) -> None:
    model = write_model_with_tokenizer(gpt2_dir, tmp_path / "model")
    contexts = [f"Tenant {t} notes: " + " ".join(f"fact {t}.{i} holds;" for i in range(12)) for t in range(2)]
    conversations = [Conversation(t, [f"Question {u} one?", f"Question {u} two?"], 4) for t in range(2) for u in range(4)]
    workload = tmp_path / "conversations.json"
    workload.write_bytes(msgspec.json.encode(ConversationWorkload(contexts, conversations)))
    output = tmp_path / "routing.json"
    serve_args = "--dtype float32 --block-size 4 --num-blocks 160"
    code = None
    try:
        bench_main(["routing", "--workload", str(workload), "--model", str(model), "--routing", "kv,round-robin",
                    "--user-rate", "20", "--serve-args", serve_args, "--timeout", "120", "--output-json", str(output)])
    except SystemExit as exc:
        code = exc.code
    assert code is None, capsys.readouterr()
    runs = {run["routing"]: run for run in json.loads(output.read_text())["runs"]}
    assert all(run["turns"] == 16 and run["failed"] == 0 and run["user_rate"] == 20 for run in runs.values())
    assert runs["kv"]["decisions"]["prefix"] > 0 and runs["round-robin"]["decisions"]["round_robin"] == 16
    # a tenant's context and a conversation's turns stay on one engine, so less is computed
    assert runs["kv"]["computed_tokens"] < runs["round-robin"]["computed_tokens"]
    assert "round-robin" in capsys.readouterr().out


@pytest.mark.parametrize("rates", ["0", "fast", ""])
def test_routing_bench_refuses_a_bad_rate_in_one_line(rates: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench_main(["routing", "--workload", str(SHIPPED), "--user-rate", rates])
    assert exit_info.value.code != 0 and "--user-rate must be" in capsys.readouterr().err
