"""`ember serve --dtype float32 --engine-resume-wait 60` from a fresh start: seconds until `ember:
ready`; then a greedy chat stream (120 tokens) whose engine is SIGKILLed after its 20th chunk.
Prints one JSON line: the start time, the stream's pause across the engine restart, and whether
its text equals the same request's text without the kill.
`python docs/results/engine_restart_resume.py PORT` from the checkout to measure."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai

PORT = int(sys.argv[1])
MODEL = "smollm2-135m-instruct"
MESSAGES = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


def engine_pid(serve_pid: int) -> int:
    children = Path(f"/proc/{serve_pid}/task/{serve_pid}/children").read_text().split()
    return next(int(pid) for pid in children if b"ember_engine" in Path(f"/proc/{pid}/cmdline").read_bytes())


with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
    argv = [sys.executable, "-m", "ember_core.cli", "serve", "--port", str(PORT), "--dtype", "float32",
            "--engine-resume-wait", "60"]
    launched = time.monotonic()
    serve = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        while "ember: ready" not in Path(log.name).read_text():
            assert serve.poll() is None, Path(log.name).read_text()
            time.sleep(0.1)
        ready_s = time.monotonic() - launched
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", max_retries=0)
        request = {"model": MODEL, "messages": MESSAGES, "max_tokens": 120, "temperature": 0}
        expected = client.chat.completions.create(**request).choices[0].message.content
        parts, gaps, last = [], [], time.monotonic()
        for index, chunk in enumerate(client.chat.completions.create(**request, stream=True)):
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
            if index == 20:
                os.kill(engine_pid(serve.pid), signal.SIGKILL)
        print(json.dumps({
            "ready_s": round(ready_s, 2), "pause_across_restart_s": round(max(gaps), 2),
            "same_text": "".join(parts) == expected, "chunks": len(gaps),
            "load_1m": os.getloadavg()[0],
        }))
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(60)
