"""`ember-engine`: load a model and serve it to gateways over ZeroMQ."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import TYPE_CHECKING

from ember_core.engine_args import add_engine_arguments, engine_kwargs_from_args
from ember_core.log_level import add_log_level_argument, configure_logging

if TYPE_CHECKING:
    from ember_engine.tracing import EngineTracer

DEFAULT_BIND = "tcp://127.0.0.1:5555"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ember-engine", description="ember engine worker")
    add_engine_arguments(parser)
    parser.add_argument("--bind", default=os.environ.get("EMBER_BIND", DEFAULT_BIND), help="tcp://HOST:PORT or ipc://PATH")
    parser.add_argument("--served-model-name", default=os.environ.get("EMBER_SERVED_MODEL_NAME"),
                        help="model id reported to clients (default: --model)")
    parser.add_argument("--heartbeat-interval", type=float, default=os.environ.get("EMBER_HEARTBEAT_INTERVAL", "1.0"))
    parser.add_argument("--shutdown-timeout", type=float, default=os.environ.get("EMBER_SHUTDOWN_TIMEOUT", "10"),
                        help="seconds in-flight requests may finish after SIGTERM before they are aborted")
    parser.add_argument("--otlp-traces-endpoint", default=os.environ.get("EMBER_OTLP_TRACES_ENDPOINT"),
                        help="export each request's spans over OTLP/HTTP to this URL, e.g. http://collector:4318 "
                        "(its /v1/traces); default off (EMBER_OTLP_TRACES_ENDPOINT)")
    add_log_level_argument(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    from ember_core.config import EngineConfig
    from ember_core.engine.engine import Engine
    from ember_core.parallel.follower import follow
    from ember_core.parallel.rank_lost import RankLost
    from ember_core.parallel.ranks import torchrun_rank
    from ember_engine.worker import EngineWorker, WorkerOptions

    try:
        config = EngineConfig(**engine_kwargs_from_args(args))
        launched = torchrun_rank() if config.tensor_parallel_size > 1 else None
        if launched is not None and launched[0] != 0:  # a follower node of a multi-node engine
            follow(config, *launched)
            return
        tracer = None if args.otlp_traces_endpoint is None else _tracer(args.otlp_traces_endpoint)
        engine = Engine(config)
        worker = EngineWorker(
            engine,
            args.served_model_name or args.model,
            WorkerOptions(args.bind, args.heartbeat_interval, args.shutdown_timeout),
            tracer,
        )
    except (ValueError, OSError) as exc:
        print(f"ember-engine: error: {exc}", file=sys.stderr)
        sys.exit(2)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.request_shutdown())
    try:
        worker.run()
    except RankLost as exc:  # exits non-zero: its supervisor restarts it, the gateways move its requests
        print(f"ember-engine: error: {exc}", file=sys.stderr)
        sys.exit(1)
    finally:
        engine.close()


def _tracer(endpoint: str) -> EngineTracer:
    from ember_core.tracing import otlp_exporter, tracer_provider
    from ember_engine.tracing import EngineTracer

    return EngineTracer(tracer_provider("ember-engine", otlp_exporter(endpoint)))


if __name__ == "__main__":
    main()
