"""`ember serve` / `ember-serve`: engines (one, or --data-parallel-size N, the cores split between
them) and one gateway routing across them, as child processes; signals forwarded, a child that
dies after serving restarted (the gateway picks up the new engine by itself)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from ember_core.engine_args import add_engine_arguments, engine_kwargs_from_args
from ember_core.log_level import add_log_level_argument
from ember_gateway.cli import add_gateway_arguments, gateway_options_argv

POLL_SECONDS = 0.2
HEALTH_CHECK_SECONDS = 1.0
STOP_GRACE_SECONDS = 15.0
MAX_RESTARTS_PER_WINDOW = 5
RESTART_WINDOW_SECONDS = 600.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ember-serve", description="serve a model on an OpenAI-compatible HTTP API")
    add_engine_arguments(parser)
    parser.add_argument(
        "--data-parallel-size", type=_positive_int, default=os.environ.get("EMBER_DATA_PARALLEL_SIZE", "1"),
        help="engines to start, each with its share of the cores, behind one gateway (EMBER_DATA_PARALLEL_SIZE)",
    )
    add_gateway_arguments(parser)
    add_log_level_argument(parser)
    return parser


def _positive_int(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value!r}")
    return int(value)


def split_cores(cores: list[int], parts: int) -> list[list[int]]:
    """Contiguous shares of the cores, as even as they go; more parts than cores share them."""
    if parts > len(cores):
        return [[cores[i % len(cores)]] for i in range(parts)]
    size, extra = divmod(len(cores), parts)
    shares, start = [], 0
    for index in range(parts):
        end = start + size + (index < extra)
        shares.append(cores[start:end])
        start = end
    return shares


def _engine_argv(args: argparse.Namespace, bind: str) -> list[str]:
    argv = [sys.executable, "-m", "ember_engine", "--bind", bind, "--log-level", args.log_level]
    for name, value in engine_kwargs_from_args(args).items():
        flag = name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(f"--{flag}" if value else f"--no-{flag}")
        elif isinstance(value, list | tuple):
            argv += [f"--{flag}", *value] if value else []
        elif value is not None:
            argv += [f"--{flag}", str(value)]
    if args.otlp_traces_endpoint is not None:  # a gateway flag the engines take too: one trace spans both
        argv += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
    return argv


def _gateway_argv(args: argparse.Namespace, engine_addresses: list[str], listen_fd: int) -> list[str]:
    engines = ",".join(engine_addresses)
    argv = [sys.executable, "-m", "ember_gateway", "--engine", engines, "--log-level", args.log_level]
    return argv + gateway_options_argv(args) + ["--listen-fd", str(listen_fd)]


def _listen(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound here so that a taken port fails at once, --port 0 gets its number,
    and connections wait in the backlog while a restarted gateway starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=1024)
    except (OSError, OverflowError) as exc:  # OverflowError: a port outside 0-65535
        errno = getattr(exc, "errno", None)
        if errno and errno < 0:  # the resolver's: create_server's message starts with its text
            reason = exc.strerror.partition(" (while attempting")[0]
        else:
            reason = os.strerror(errno) if errno else exc
        sys.exit(f"ember: error: cannot listen on {host}:{port}: {reason}")


def _stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class Child:
    """A child process the launcher restarts when it dies after the server was once healthy (a
    crash or a kill, also while a restart is loading), within a budget, but not when it dies before
    the server ever became healthy (a bad flag, a model that does not load): that ends
    `ember serve` instead of looping."""

    def __init__(self, name: str, argv: list[str], pass_fds: tuple[int, ...] = (), cores: list[int] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.pass_fds = pass_fds
        self.cores = cores  # the CPUs it may run on, and as many threads; None: all, as the OS decides
        self.process = self._start()
        self.served = False
        self.restarts: list[float] = []

    def restart(self) -> bool:
        """Start it again after an unexpected exit; False when it should not be (see the class)."""
        code = self.process.returncode
        cause = f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_SECONDS]
        if not self.served or len(self.restarts) >= MAX_RESTARTS_PER_WINDOW:
            why = "before the server became healthy" if not self.served else "too often"
            print(f"ember: the {self.name} exited with {cause} {why}; stopping", file=sys.stderr, flush=True)
            return False
        print(f"ember: the {self.name} exited with {cause}; restarting it", file=sys.stderr, flush=True)
        self.restarts.append(now)
        self.process = self._start()
        return True

    def _start(self) -> subprocess.Popen:
        if self.cores is None:
            return subprocess.Popen(self.argv, pass_fds=self.pass_fds)
        cores = self.cores
        env = {**os.environ, "OMP_NUM_THREADS": str(len(cores))}
        return subprocess.Popen(
            self.argv, pass_fds=self.pass_fds, env=env,
            preexec_fn=lambda: os.sched_setaffinity(0, cores),  # noqa: PLW1509 (the launcher runs no threads)
        )


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200
    except (OSError, ValueError):
        return False


def _start_engines(args: argparse.Namespace, run_dir: str) -> list[tuple[str, Child]]:
    if args.data_parallel_size == 1:
        address = f"ipc://{run_dir}/engine.sock"
        return [(address, Child("engine", _engine_argv(args, address)))]
    engines = []
    for index, cores in enumerate(split_cores(sorted(os.sched_getaffinity(0)), args.data_parallel_size)):
        address = f"ipc://{run_dir}/engine-{index}.sock"
        print(f"ember: engine {index}: {len(cores)} threads on cores {cores}", file=sys.stderr, flush=True)
        engines.append((address, Child(f"engine {index}", _engine_argv(args, address), cores=cores)))
    return engines


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    listener = _listen(args.host, args.port)
    port = listener.getsockname()[1]
    local_host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]"}.get(args.host, args.host)
    if ":" in local_host and not local_host.startswith("["):
        local_host = f"[{local_host}]"
    health_url = f"http://{local_host}:{port}/health"
    with listener, tempfile.TemporaryDirectory(prefix="ember-") as run_dir:
        engines = _start_engines(args, run_dir)
        addresses = [address for address, _ in engines]
        gateway = Child("gateway", _gateway_argv(args, addresses, listener.fileno()), pass_fds=(listener.fileno(),))
        children = [gateway] + [engine for _, engine in engines]  # the gateway stops first: clients see a clean close
        stop_requested = failed = False

        def on_signal(*_) -> None:
            nonlocal stop_requested
            stop_requested = True

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        print(f"ember: serving {args.model} on http://{args.host}:{port}/v1", file=sys.stderr, flush=True)
        next_health_check = 0.0
        while not stop_requested and not failed:
            time.sleep(POLL_SECONDS)
            exited = [child for child in children if child.process.poll() is not None]
            failed = not all(child.restart() for child in exited)
            if time.monotonic() >= next_health_check and not all(child.served for child in children):
                next_health_check = time.monotonic() + HEALTH_CHECK_SECONDS
                if _healthy(health_url):  # the gateway answers and its engine is ready
                    print("ember: ready", file=sys.stderr, flush=True)
                    for child in children:
                        child.served = True
        _stop([child.process for child in children])
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
