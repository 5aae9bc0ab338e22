"""GET /dashboard in headless Chromium, driven over the DevTools protocol, against `ember serve
--data-parallel-size 2` serving the default model: the page shows both engines, their blocks turn
from free to held under load and back to free after it, the models table counts the requests and
tokens, and a screenshot taken under load is written
next to the test's logs (dashboard.png). Hovering a held block names the request holding it."""

from __future__ import annotations

import asyncio
import base64
import itertools
import re
import shutil
import subprocess
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.processes import served, stop_process

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (make test installs it as root)")
SERVE_FLAGS = ("--data-parallel-size", "2", "--num-blocks", "96", "--block-size", "16", "--max-num-seqs", "8",
               "--model-name", "smollm2-135m-instruct")
# Where the first engine's first held block is drawn, in the page's coordinates.
FIRST_HELD_CELL = """(() => {
    const view = [...engines.values()][0], grid = view.grid, box = view.blocks.getBoundingClientRect();
    const cell = Math.floor(grid.holders.findIndex(value => value >= BLOCK_HELD) / grid.blocksPerCell);
    return {x: box.left + (cell % grid.columns) * CELL_PX + 3, y: box.top + Math.floor(cell / grid.columns) * CELL_PX + 3};
})()"""
# A pool of 64k blocks, drawn as the feed would send it: it must fit in at most 40 rows of cells.
HUGE_POOL = """(() => {
    const bytes = new Uint8Array(2 * 65536);
    for (let i = 0; i < 65536; i++) bytes[2 * i] = i % 3;
    let binary = "";
    for (const byte of bytes) binary += String.fromCharCode(byte);
    showEngine({address: "synthetic", engine_id: "x", model: "m", accepting: true, num_blocks: 65536,
                holders: btoa(binary), running: ["r"], waiting: [], steps: []});
    const root = [...document.querySelectorAll('.engine')].find(e => e.dataset.engineId === "x");
    return {blocksPerCell: Number(root.dataset.blocksPerCell), height: root.querySelector('canvas.blocks').clientHeight,
            held: Number(root.dataset.held)};
})()"""
MODEL_ROW = """[...(document.querySelector('#models tbody tr') ?? {cells: []}).cells].map(cell => cell.textContent)"""
ENGINES = """[...document.querySelectorAll('.engine')].map(e => ({
    id: e.dataset.engineId, held: Number(e.dataset.held), free: Number(e.dataset.free)}))"""


class DevTools:
    """One page's DevTools session: commands by id, their results awaited."""

    def __init__(self, socket: aiohttp.ClientWebSocketResponse) -> None:
        self._socket = socket
        self._ids = itertools.count(1)

    async def command(self, method: str, **params: Any) -> dict[str, Any]:
        command_id = next(self._ids)
        await self._socket.send_json({"id": command_id, "method": method, "params": params})
        while True:
            message = await self._socket.receive_json(timeout=60)
            if message.get("id") == command_id:
                assert "error" not in message, message
                return message["result"]

    async def evaluate(self, expression: str) -> Any:
        result = await self.command("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    async def until(self, expression: str, condition: Callable[[Any], bool], what: str, timeout: float = 120) -> Any:
        value = None
        try:
            async with asyncio.timeout(timeout):
                while not condition(value := await self.evaluate(expression)):
                    await asyncio.sleep(0.1)
        except TimeoutError:
            raise AssertionError(f"timed out waiting for {what}; the page shows {value}") from None
        return value


def _start_chromium(log: Path, user_data: Path) -> subprocess.Popen:
    argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-port=0",
            f"--user-data-dir={user_data}", "--window-size=1400,1000", "about:blank"]
    with open(log, "wb") as output:
        return subprocess.Popen(argv, stdout=output, stderr=subprocess.STDOUT)


@asynccontextmanager
async def chromium(log: Path, user_data: Path) -> AsyncIterator[DevTools]:
    process = _start_chromium(log, user_data)
    try:
        port = await _devtools_port(log, process)
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/json/list") as response:
                page = next(target for target in await response.json() if target["type"] == "page")
            async with session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as socket:
                yield DevTools(socket)
    finally:
        stop_process(process)


async def _devtools_port(log: Path, process: subprocess.Popen) -> int:
    async with asyncio.timeout(60):
        while not (found := re.search(r"DevTools listening on ws://[^:]+:(\d+)/", log.read_text(errors="replace"))):
            assert process.poll() is None, log.read_text()
            await asyncio.sleep(0.1)
    return int(found.group(1))


async def _load(url: str, model: str, count: int) -> None:
    async with aiohttp.ClientSession() as session:
        async def one(index: int) -> None:
            body = {"model": model, "prompt": f"Story {index}: once upon a time, in a town by the sea,",
                    "max_tokens": 48, "temperature": 0, "ignore_eos": True}
            async with session.post(f"{url}/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()

        await asyncio.gather(*(one(index) for index in range(count)))


async def test_the_page_shows_both_engines_blocks_held_under_load_and_freed_after(
    smollm2_gguf_path: Path, tmp_path: Path
) -> None:
    with served(smollm2_gguf_path, tmp_path / "serve.log", *SERVE_FLAGS) as url:
        async with aiohttp.ClientSession() as session:
            async with asyncio.timeout(120):
                while len((health := await (await session.get(f"{url}/health")).json())["engines"]) < 2:
                    await asyncio.sleep(0.2)
        async with chromium(tmp_path / "chromium.log", tmp_path / "profile") as page:
            await page.command("Page.navigate", url=f"{url}/dashboard")
            idle = await page.until(ENGINES, lambda engines: len(engines or []) == 2 and all(
                e["free"] + e["held"] > 0 for e in engines), "both engines drawn")
            assert all(engine["held"] == 0 for engine in idle) and len({e["id"] for e in idle}) == 2
            load = asyncio.create_task(_load(url, health["model"], count=16))
            await page.until(ENGINES, lambda engines: all(e["held"] > 0 for e in engines), "blocks held on both")
            cell = await page.evaluate(FIRST_HELD_CELL)
            await page.command("Input.dispatchMouseEvent", type="mouseMoved", x=cell["x"], y=cell["y"])
            assert re.fullmatch(r"block \d+: held by cmpl-\S+", await page.evaluate("tooltip.textContent"))
            await asyncio.sleep(1)  # an update or two more, for the charts
            shot = await page.command("Page.captureScreenshot", format="png")
            (tmp_path / "dashboard.png").write_bytes(base64.b64decode(shot["data"]))
            print(f"screenshot: {tmp_path / 'dashboard.png'}")
            await load
            await page.until(ENGINES, lambda engines: all(e["held"] == 0 for e in engines), "every block free again")
            assert await page.evaluate("document.getElementById('tokens-per-s').textContent") != "–"
            row = await page.until(MODEL_ROW, lambda cells: bool(cells) and int(cells[3]) >= 16, "the model's 16 requests")
            assert row[:3] == [health["model"], "", "2"] and int(row[5]) >= 16 * 48
            huge = await page.evaluate(HUGE_POOL)
            assert huge["blocksPerCell"] > 1 and huge["height"] <= 40 * 9 and huge["held"] == 65536 // 3
