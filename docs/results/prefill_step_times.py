"""Per-step times of one prompt alone, prefilled in N-token chunks with the context charge off:
`python docs/results/prefill_step_times.py N PROMPT_TOKENS`; prints a JSON line of (context, ms)."""

import json
import sys
import time

from ember_core import LLM, SamplingParams

chunk, num_tokens = int(sys.argv[1]), int(sys.argv[2])
engine = LLM("smollm2-135m-instruct", dtype="float32", max_num_batched_tokens=chunk).engine
engine.scheduler.context_cost = 0.0
engine.add_request("r", [(i * 7919) % 40000 + 100 for i in range(num_tokens)], SamplingParams(max_tokens=1, temperature=0))
rows, context = [], 0
while engine.has_unfinished():
    started = time.perf_counter()
    engine.step()
    rows.append((context, round((time.perf_counter() - started) * 1000)))
    context += chunk
print(json.dumps({"n": chunk, "steps": rows}))
