"""Four streams decode; a long prompt arrives; per-step times until its first token:
`python docs/results/long_prompt_mix.py PROMPT_TOKENS LABEL`; prints a JSON line."""

import json
import statistics
import sys
import time

from ember_core import LLM, SamplingParams

num_long, label = int(sys.argv[1]), sys.argv[2]
engine = LLM("smollm2-135m-instruct", dtype="float32").engine
for i in range(4):
    prompt = [(i * 31 + j * 7) % 30000 + 100 for j in range(40)]
    engine.add_request(f"s{i}", prompt, SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True))
for _ in range(3):
    engine.step()
started = time.perf_counter()
engine.add_request("long", [(i * 7919) % 40000 + 100 for i in range(num_long)], SamplingParams(max_tokens=1, temperature=0))
steps, stream_tokens = [], 0
while True:
    step_started = time.perf_counter()
    deltas = engine.step()
    steps.append(time.perf_counter() - step_started)
    stream_tokens += sum(len(d.new_token_ids) for d in deltas if d.request_id != "long")
    if any(d.request_id == "long" for d in deltas):
        break
ttft = time.perf_counter() - started
print(json.dumps({
    "label": label, "n_long": num_long, "ttft_s": round(ttft, 2), "steps": len(steps),
    "step_max_s": round(max(steps), 2), "step_p50_s": round(statistics.median(steps), 2),
    "short_tokens_per_stream": stream_tokens / 4, "short_tok_s": round(stream_tokens / ttft, 2),
}))
