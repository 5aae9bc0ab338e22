"""`ember` command line: generate (the in-process engine), bench, and serve (the launcher); the
engine flags map onto the same EngineConfig fields as LLM(**kwargs)."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Callable

from ember_bench.cli import add_bench_parser, run_bench
from ember_cli.sampling_flags import add_sampling_arguments, sampling_params_from_args
from ember_core.engine_args import add_engine_arguments, engine_kwargs_from_args
from ember_core.log_level import add_log_level_argument, configure_logging


def _generate(args: argparse.Namespace) -> None:
    from ember_core.llm import LLM

    params = sampling_params_from_args(args)
    llm = LLM(**engine_kwargs_from_args(args))
    if llm.tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer files, and ember generate takes text prompts")
    for output in llm.generate(args.prompt, params):
        for completion in output.outputs:  # n of them
            print(output.prompt + completion.text if args.echo else completion.text, flush=True)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Callable[[argparse.Namespace], None]]]:
    parser = argparse.ArgumentParser(prog="ember", description="ember LLM inference server")
    add_log_level_argument(parser, default=None)  # WARNING, or ember serve's own default
    parser.add_argument("--version", action="version", version=f"ember {importlib.metadata.version('ember')}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts with the offline engine")
    add_engine_arguments(gen)
    gen.add_argument("prompt", nargs="+")
    add_sampling_arguments(gen)
    gen.add_argument("--echo", action="store_true", help="print the prompt before its completion")
    add_log_level_argument(gen, default=argparse.SUPPRESS)  # as `ember --log-level L generate`
    add_bench_parser(sub)
    # every argument after `serve` is ember-serve's (main hands them over)
    sub.add_parser("serve", help="serve a model on an OpenAI-compatible HTTP API (same as ember-serve)", add_help=False)
    return parser, {"generate": _generate, "bench": run_bench}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        from ember_cli.serve import main as serve

        return serve(argv[1:])
    parser, commands = build_parser()
    args, serve_argv = parser.parse_known_args(argv)
    if args.command == "serve":  # `ember --log-level L serve ...`
        from ember_cli.serve import main as serve

        return serve((["--log-level", args.log_level] if args.log_level else []) + serve_argv)
    if serve_argv:
        parser.error(f"unrecognized arguments: {' '.join(serve_argv)}")
    configure_logging(args.log_level or "WARNING")
    try:
        commands[args.command](args)
    except (ValueError, OSError) as exc:
        print(f"ember: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
