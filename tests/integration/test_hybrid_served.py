"""A hybrid model (Qwen3.5's Gated DeltaNet layers beside attention; Granite 4.0-H's Mamba2 layers
beside attention and experts) served by real engine and gateway processes: concurrent multi-turn
chats whose later turns resume from their state checkpoints, and long answers that outgrow the pool
and are preempted, each answer the same as a cacheless engine's; and an engine killed mid-stream
whose requests finish on the other one."""

from __future__ import annotations

import asyncio
import signal
from contextlib import ExitStack
from pathlib import Path

import aiohttp
import pytest

from ember_bench.families import FAMILIES
from ember_bench.random_tokenizers import write_tokenizer
from tests.families import VOCAB, write_hybrid_checkpoint
from tests.integration.test_data_parallel import gateway, metric_sum, start_engine, texts

TURNS = 3
QUESTIONS = ["Tell me about rivers.", "And forests?", "What about castles?", "Markets, then?"]


@pytest.fixture(scope="module", params=["qwen3_5", "granitemoehybrid_moe"])
def hybrid_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = tmp_path_factory.mktemp(f"{request.param}_served")
    write_hybrid_checkpoint(model_dir, seed=2, family=request.param)
    write_tokenizer(model_dir, "qwen2", FAMILIES["qwen2"].specials, VOCAB)
    return model_dir


def _chat(messages: list[dict[str, str]], stream: bool) -> dict:
    return {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": stream}


async def test_multi_turn_chats_resume_from_state_checkpoints_and_a_full_pool_preempts(hybrid_dir: Path, tmp_path: Path):
    with ExitStack() as stack:
        # 100 blocks of 4 tokens: four conversations keep their earlier turns cached; four long
        # answers at once outgrow the pool.
        engine, _ = start_engine(stack, hybrid_dir, tmp_path / "engine.log", "--num-blocks", "100")
        cacheless, _ = start_engine(stack, hybrid_dir, tmp_path / "cacheless.log", "--no-enable-prefix-caching")
        url, reference = gateway(stack, [engine], tmp_path / "gw.log"), gateway(stack, [cacheless], tmp_path / "ref.log")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:

            async def conversation(index: int) -> None:
                messages = [{"role": "system", "content": f"You are assistant number {index}."}]
                for turn in range(TURNS):
                    messages.append({"role": "user", "content": QUESTIONS[(index + turn) % len(QUESTIONS)]})
                    answer = (await texts(session, url, "chat", {**_chat(messages, stream=turn % 2 == 1), "n": 1}))[0]
                    expected = (await texts(session, reference, "chat", {**_chat(messages, stream=False), "n": 1}))[0]
                    assert answer == expected, (index, turn)
                    messages.append({"role": "assistant", "content": answer})

            await asyncio.gather(*(conversation(index) for index in range(4)))
            assert await metric_sum(session, [url], "ember_prefix_cache_hits_total") > 0
            assert await metric_sum(session, [url], "ember_state_slots") > 0

            long_answers = [{**_chat([{"role": "user", "content": question * 3}], stream=True), "max_tokens": 120, "n": 1}
                            for question in QUESTIONS]
            answers = await asyncio.gather(*(texts(session, url, "chat", request) for request in long_answers))
            assert await metric_sum(session, [url], "ember_num_preemptions_total") > 0
            for request, answer in zip(long_answers, answers):
                assert answer == (await texts(session, reference, "chat", {**request, "stream": False}))


async def test_an_engine_killed_mid_stream_loses_no_request(hybrid_dir: Path, tmp_path: Path):
    with ExitStack() as stack:
        (first, first_process), (second, _) = (
            start_engine(stack, hybrid_dir, tmp_path / f"engine{i}.log") for i in (1, 2)
        )
        alone, url = gateway(stack, [second], tmp_path / "alone.log"), gateway(stack, [first, second], tmp_path / "gw.log")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            prompts = [[{"role": "user", "content": f"Question {i}: {QUESTIONS[i % 4]}"}] for i in range(24)]
            expected = [(await texts(session, alone, "chat", {**_chat(p, stream=False), "n": 1}))[0] for p in prompts]
            done = 0

            async def one(index: int) -> str:
                nonlocal done
                result = (await texts(session, url, "chat", {**_chat(prompts[index], stream=True), "n": 1}))[0]
                done += 1
                return result

            tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
            while done < 4:
                await asyncio.sleep(0.01)
            first_process.send_signal(signal.SIGKILL)
            assert await asyncio.gather(*tasks) == expected
