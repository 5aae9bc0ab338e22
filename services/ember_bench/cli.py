"""`ember bench serve|offline`: arguments, and the contract that a bad input is one line on stderr
and exit code 2. `ember` imports this module to build its parser, so everything heavier than argparse
(numpy, aiohttp, torch) is imported only by the command that runs."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ember_bench.families import FAMILIES
from ember_bench.workload import BenchRequest, RandomPrompts, load_workload, take
from ember_core.config import DEFAULT_MODEL, KV_CACHE_DTYPES, EngineConfig
from ember_core.log_level import add_log_level_argument, configure_logging

ENGINE_FLAGS = (
    "block_size", "num_blocks", "kv_cache_mib", "kv_cache_dtype", "max_num_batched_tokens", "max_model_len", "device",
    "tensor_parallel_size",
)  # fmt: skip


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `bench` on an `ember` subparsers object; dispatch the parsed args with run_bench."""
    bench = subparsers.add_parser("bench", help="benchmark an OpenAI-compatible server or the offline engine")
    _add_commands(bench)
    return bench


def run_bench(args: argparse.Namespace) -> None:
    """Run the parsed command. Bad inputs raise ValueError or OSError with a one-line message."""
    exit_code = args.bench_handler(args)
    if exit_code:
        sys.exit(exit_code)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ember bench", description="benchmark an ember server or engine")
    _add_commands(parser)
    args = parser.parse_args(argv)
    configure_logging(getattr(args, "log_level", "WARNING"))
    try:
        run_bench(args)
    except (ValueError, OSError) as exc:
        print(f"ember bench: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


def _add_commands(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="bench_command", required=True)
    serve = commands.add_parser(
        "serve", help="load an OpenAI-compatible /v1/completions endpoint with streamed requests"
    )
    _add_workload_arguments(serve, "words")
    serve.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (a trailing /v1 is accepted)")
    serve.add_argument("--model", help="model name to send (default: the first id GET /v1/models lists); A,B,...: "
                                       "requests take them in turn, e.g. LoRA adapters and their base")
    serve.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    serve.add_argument("--concurrency", type=int, metavar="C", help="most requests in flight at once (default: no cap)")
    serve.add_argument("--request-rate", type=float, metavar="R",
                       help="Poisson arrivals at this many requests/s (default: all requests at once)")
    serve.add_argument("--ignore-eos", action="store_true",
                       help="send ignore_eos: true so each request runs to max_tokens")
    serve.add_argument("--timeout", type=float, default=300.0, metavar="S",
                       help="seconds before one request counts as failed")
    serve.add_argument("--goodput", nargs="+", metavar="METRIC:MS", default=[],
                       help="SLOs for goodput, any of ttft:MS tpot:MS e2e:MS")
    serve.add_argument("--output-json", metavar="PATH", help="write the configuration and every number here")
    serve.set_defaults(bench_handler=_serve)
    add_log_level_argument(serve, default=argparse.SUPPRESS)  # as `ember --log-level L bench serve`

    kernels = commands.add_parser(
        "kernels", help="this CPU's arithmetic peak, then every CPU kernel as GF/s, GB/s and share of it"
    )
    kernels.add_argument("--formats", default="F32,BF16,Q8_0,Q4_1", metavar="F1,F2,...",
                         help="weight formats of the layer linears (F32 / BF16: dense weights)")
    kernels.add_argument("--rows", default="1,4,16,64,512", metavar="R1,R2,...",
                         help="rows per call (sequences of a decode step; 512: a prefill chunk)")
    kernels.add_argument("--dtypes", default="float32,bfloat16", metavar="D1,D2", help="activation dtypes")
    kernels.add_argument("--batches", default="1,16", metavar="B1,B2", help="decode batches of the attention rows")
    kernels.add_argument("--context", type=int, default=512, metavar="N", help="tokens each sequence attends over")
    kernels.add_argument("--repeats", type=int, default=5, metavar="N", help="calls timed per row (the median)")
    kernels.add_argument("--layers", type=int, default=30, metavar="N", help="layers of weights and K/V a call streams")
    kernels.add_argument("--output-json", metavar="PATH", help="write the peak and every timing here")
    kernels.set_defaults(bench_handler=_kernels)
    add_log_level_argument(kernels, default=argparse.SUPPRESS)

    routing = commands.add_parser(
        "routing", help="conversations through `ember serve --data-parallel-size N` under each routing mode"
    )
    routing.add_argument("--workload", required=True, metavar="PATH",
                         help="conversations JSON (python -m ember_bench.conversations makes one)")
    routing.add_argument("--model", default=DEFAULT_MODEL, help="what ember serve loads")
    routing.add_argument("--data-parallel-size", type=int, default=2, metavar="N", help="engines, the cores split")
    routing.add_argument("--routing", default="kv,load,round-robin", metavar="MODES",
                         help="comma-separated gateway routing modes, each on a fresh server")
    routing.add_argument("--concurrency", type=int, metavar="C", help="most turns in flight (default: every user)")
    routing.add_argument("--user-rate", default="all", metavar="RATES",
                         help="comma-separated conversations starting per second (Poisson arrivals), "
                              "'all' for all at once; each rate runs every mode, e.g. 1,2,4,8,all")
    routing.add_argument("--seed", type=int, default=0, help="for the arrivals")
    routing.add_argument("--timeout", type=float, default=600.0, metavar="S", help="seconds before a turn fails")
    routing.add_argument("--serve-args", default="", metavar="ARGS",
                         help="more `ember serve` flags, as one string, e.g. '--kv-cache-mib 256'")
    routing.add_argument("--output-json", metavar="PATH", help="write the configuration and every run here")
    routing.set_defaults(bench_handler=_routing)
    add_log_level_argument(routing, default=argparse.SUPPRESS)

    abuse = commands.add_parser(
        "abuse", help="a fresh `ember serve` under slowloris, slow bodies, idle connections, a disconnect storm, a soak"
    )
    abuse.add_argument("--model", default=DEFAULT_MODEL, help="what ember serve loads")
    abuse.add_argument("--slow-connections", type=int, default=400, metavar="N", help="slowloris connections")
    abuse.add_argument("--idle-connections", type=int, default=200, metavar="N")
    abuse.add_argument("--slow-bodies", type=int, default=100, metavar="N")
    abuse.add_argument("--storm-requests", type=int, default=100, metavar="N", help="requests whose clients leave")
    abuse.add_argument("--soak", type=float, default=60.0, metavar="S", help="seconds of mixed load at the end")
    abuse.add_argument("--soak-concurrency", type=int, default=8, metavar="C")
    abuse.add_argument("--rounds", type=int, default=2, metavar="N",
                       help="the attacks N times on one server: later rounds show what grows")
    abuse.add_argument("--serve-args", default="", metavar="ARGS", help="more `ember serve` flags, as one string")
    abuse.add_argument("--output-json", metavar="PATH", help="write the configuration and every number here")
    abuse.set_defaults(bench_handler=_abuse)
    add_log_level_argument(abuse, default=argparse.SUPPRESS)

    offline = commands.add_parser("offline", help="the in-process engine across batching, admission and dtype settings")
    add_log_level_argument(offline, default=argparse.SUPPRESS)
    _add_workload_arguments(offline, "words, or token ids when the model has no tokenizer")
    defaults = EngineConfig()
    offline.add_argument("--model", default=DEFAULT_MODEL, help="local dir, .gguf file, hub repo id or short name")
    offline.add_argument("--compare", default="batching,admission,dtype", metavar="AXES",
                         help="comma-separated axes, each run against the baseline with only that axis switched: "
                              "batching, admission, dtype, gguf_weights, prefix_caching, structured_outputs, "
                              "numerics ('' for the baseline alone)")
    offline.add_argument("--concurrency", default="1,4,16", metavar="C1,C2,...",
                         help="comma-separated max_num_seqs (batch sizes) to sweep")
    offline.add_argument("--batching", choices=["continuous", "static"], default=defaults.batching, help="baseline")
    offline.add_argument("--admission", choices=["preempt", "reserve"], default=defaults.admission, help="baseline")
    offline.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="baseline")
    offline.add_argument("--gguf-weights", choices=["blocks", "dequantized"], default=defaults.gguf_weights,
                         help="baseline: run GGUF blocks and 16-bit weights as stored or dequantized")
    offline.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=defaults.enable_prefix_caching,
                         help="baseline: reuse cached prompt prefixes within the run (never across runs)")
    offline.add_argument("--structured-outputs", action=argparse.BooleanOptionalAction, default=False,
                         help="baseline: constrain every output to a JSON schema that runs to max_tokens")
    offline.add_argument("--numerics", choices=["exact", "fast"], default="exact",
                         help="baseline: the linears' arithmetic (ember serve --numerics)")
    offline.add_argument("--device", help="cuda, mps or cpu (default: detected)")
    offline.add_argument("--block-size", type=int, default=defaults.block_size)
    offline.add_argument("--num-blocks", type=int, help="KV pool size in blocks (overrides --kv-cache-mib)")
    offline.add_argument("--kv-cache-mib", type=float, default=defaults.kv_cache_mib)
    offline.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=defaults.kv_cache_dtype)
    offline.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    offline.add_argument("--max-model-len", type=int)
    offline.add_argument("--tensor-parallel-size", type=int, default=defaults.tensor_parallel_size,
                         help="split the model over this many processes on this host, the cores shared out")
    offline.add_argument("--rounds", type=int, default=1, metavar="N",
                         help="run every setting N times, interleaved, and report each one's median round")
    offline.add_argument("--transformers", action="store_true",
                         help="add a transformers static-batch generate baseline, measured in the same run")
    offline.add_argument("--output-json", metavar="PATH", help="write the configuration and every run here")
    offline.add_argument("--plot", metavar="PATH", help="write a PNG of throughput and latency against concurrency")
    offline.set_defaults(bench_handler=_offline)

    make_model = commands.add_parser(
        "make-model", help="a random-weight Hugging Face checkpoint of a model family, optionally also as GGUF files"
    )
    make_model.add_argument("--family", required=True, help=", ".join(FAMILIES))
    make_model.add_argument("--preset", help="a benchmark shape instead of the tiny default: qwen2.5-0.5b, "
                                             "qwen3-moe-bench, qwen3-dense-bench or qwen3.5-0.8b")
    make_model.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                            help="config values over the shape, VALUE as JSON: num_hidden_layers=4 sliding_window=8")
    make_model.add_argument("--seed", type=int, default=0)
    make_model.add_argument("--out", required=True, metavar="DIR", help="the checkpoint directory to write")
    make_model.add_argument("--gguf", nargs="+", default=[], metavar="TYPE",
                            help="also write DIR/model-TYPE.gguf for each TYPE: F32, F16, BF16, Q8_0, Q5_1, Q5_0, "
                                 "Q4_1 or Q4_0")
    make_model.set_defaults(bench_handler=_make_model)
    add_log_level_argument(make_model, default=argparse.SUPPRESS)

    make_adapters = commands.add_parser(
        "make-adapters", help="random PEFT LoRA adapters shaped for a model (a GGUF file included), one per --out DIR"
    )
    make_adapters.add_argument("--model", default=DEFAULT_MODEL, help="local dir, .gguf file, hub repo id or short name")
    make_adapters.add_argument("--rank", type=int, default=16)
    make_adapters.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", metavar="M1,M2,...",
                               help="the modules adapted, as PEFT's target_modules (lm_head included)")
    make_adapters.add_argument("--seed", type=int, default=0, help="the first adapter's; the next take seed + 1, ...")
    make_adapters.add_argument("--out", required=True, nargs="+", metavar="DIR")
    make_adapters.set_defaults(bench_handler=_make_adapters)
    add_log_level_argument(make_adapters, default=argparse.SUPPRESS)

    tp_costs = commands.add_parser(
        "tp-costs", help="tensor parallelism's costs on this host: one sum across N ranks (shared memory and "
                         "gloo), and with --model the step's linears on one thread, which N ranks share out"
    )
    tp_costs.add_argument("--tensor-parallel-size", type=int, default=2, metavar="N")
    tp_costs.add_argument("--rows", default="1,16", metavar="R1,R2,...", help="tokens of the step")
    tp_costs.add_argument("--hidden", type=int, default=896, help="the sums' width (Qwen2.5-0.5B's hidden size)")
    tp_costs.add_argument("--repeats", type=int, default=2000, help="sums timed per shape (the median)")
    tp_costs.add_argument("--model", help="also time this model's linears per decode step, one thread")
    tp_costs.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    tp_costs.add_argument("--numerics", choices=["exact", "fast"], default="exact")
    tp_costs.set_defaults(bench_handler=_tp_costs)
    add_log_level_argument(tp_costs, default=argparse.SUPPRESS)

    families = commands.add_parser(
        "families", help="every model family's decode step at the same shapes, against Llama's (random GGUF models)"
    )
    dense_decoders = ",".join(
        name for name, family in FAMILIES.items() if family.decoder and not family.moe and not family.hybrid
    )
    families.add_argument("--families", default=dense_decoders, metavar="F1,F2,...", help="the first is the baseline")
    families.add_argument("--type", default="Q8_0", metavar="TYPE", help="the GGUF type the models are written in")
    families.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    families.add_argument("--batch", type=int, default=16, help="sequences decoding together")
    families.add_argument("--prompt-len", type=int, default=128, help="each sequence's context before decoding")
    families.add_argument("--steps", type=int, default=24, help="decode steps timed per round")
    families.add_argument("--rounds", type=int, default=3, help="every family once per round, interleaved")
    families.add_argument("--output-json", metavar="PATH")
    families.set_defaults(bench_handler=_families)
    add_log_level_argument(families, default=argparse.SUPPRESS)

    context = commands.add_parser(
        "context", help="one stream's decode time at a short and a long context, and a conversation's next-turn TTFT"
    )
    context.add_argument("--url", required=True, help="a running server, e.g. http://127.0.0.1:8000")
    context.add_argument("--short", type=int, default=100, help="prompt tokens of the short context")
    context.add_argument("--long", type=int, default=8000, help="prompt tokens of the long context")
    context.add_argument("--turn", type=int, default=2000, help="prompt tokens of a conversation's first turn")
    context.add_argument("--output", type=int, default=32, help="tokens each request generates")
    context.add_argument("--rounds", type=int, default=3, help="requests per measurement (their median)")
    context.add_argument("--output-json", metavar="PATH")
    context.set_defaults(bench_handler=_context)
    add_log_level_argument(context, default=argparse.SUPPRESS)

    moe = commands.add_parser(
        "moe", help="a mixture of experts' decode step against the dense model of its active size (random GGUF models)"
    )
    moe.add_argument("--type", default="Q8_0", metavar="TYPE", help="the GGUF type the models are written in")
    moe.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    moe.add_argument("--batches", default="1,16", metavar="B1,B2,...", help="sequences decoding together")
    moe.add_argument("--prompt-len", type=int, default=128, help="each sequence's context before decoding")
    moe.add_argument("--steps", type=int, default=16, help="decode steps timed per round")
    moe.add_argument("--rounds", type=int, default=3, help="both models once per round, alternating which goes first")
    moe.add_argument("--output-json", metavar="PATH")
    moe.set_defaults(bench_handler=_moe)
    add_log_level_argument(moe, default=argparse.SUPPRESS)

    fidelity = commands.add_parser(
        "fidelity", help="KL divergence and top-1 agreement of a numerics mode against float32 on the same weights"
    )
    fidelity.add_argument("--model", default=DEFAULT_MODEL, help="local dir, .gguf file, hub repo id or short name")
    fidelity.add_argument("--numerics", choices=["exact", "fast"], default="fast", help="the arithmetic measured")
    fidelity.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="its activations' dtype")
    fidelity.add_argument("--kv-cache-dtype", choices=[name for name in KV_CACHE_DTYPES if name != "auto"],
                          help="measure this KV cache against one in the model's dtype, the computation otherwise the same "
                               "(a float16 or bfloat16 one gives the 8-bit ones' scale; with --llama-cpp-dir: "
                               "llama.cpp's q8_0 K/V against its float16 cache)")
    fidelity.add_argument("--text", metavar="PATH", help="the text scored (default: the shipped workloads/fidelity.txt)")
    fidelity.add_argument("--context", type=int, default=1024, metavar="N",
                          help="tokens per window; each window's second half is scored (llama-perplexity's -c)")
    fidelity.add_argument("--max-windows", type=int, metavar="N", help="score at most this many windows")
    fidelity.add_argument("--llama-cpp-dir", metavar="DIR",
                          help="a llama.cpp build's bin directory: also measure llama.cpp's arithmetic on the file")
    fidelity.add_argument("--output-json", metavar="PATH")
    fidelity.set_defaults(bench_handler=_fidelity)
    add_log_level_argument(fidelity, default=argparse.SUPPRESS)

    determinism = commands.add_parser(
        "determinism", help="replay requests under random batch mixes, prefix hits and chunk sizes; count distinct outputs"
    )
    determinism.add_argument("--model", default=DEFAULT_MODEL, help="local dir, .gguf file, hub repo id or short name")
    determinism.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    determinism.add_argument("--numerics", choices=["auto", "exact", "fast"], default="auto")
    determinism.add_argument("--prompts", type=int, default=8, metavar="N",
                             help="prompts of the shipped workload (every other one lengthened), each greedy and seeded")
    determinism.add_argument("--replays", type=int, default=24, metavar="N", help="the first runs each request alone")
    determinism.add_argument("--max-tokens", type=int, default=16, metavar="N")
    determinism.add_argument("--seed", type=int, default=0, help="for the replays' mixes and the samples")
    determinism.add_argument("--output-json", metavar="PATH")
    determinism.set_defaults(bench_handler=_determinism)
    add_log_level_argument(determinism, default=argparse.SUPPRESS)

    export = commands.add_parser("export-gguf", help="write a Hugging Face checkpoint directory as a GGUF file")
    export.add_argument("model_dir", metavar="DIR")
    export.add_argument("--out", required=True, metavar="FILE")
    export.add_argument("--type", default="F32", metavar="TYPE", help="F32, F16, BF16, Q8_0, Q5_1, Q5_0, Q4_1 or Q4_0")
    export.set_defaults(bench_handler=_export_gguf)
    add_log_level_argument(export, default=argparse.SUPPRESS)


def _add_workload_arguments(parser: argparse.ArgumentParser, random_kind: str) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--workload", metavar="PATH", help="JSON list of {prompt, max_tokens} (other keys ignored)")
    source.add_argument("--random-prompts", type=int, metavar="N", help=f"N random prompts of {random_kind}")
    parser.add_argument("--random-input-len", type=int, default=64, metavar="L", help="length of each random prompt")
    parser.add_argument("--random-output-len", type=int, default=64, metavar="M",
                        help="max_tokens of each random prompt")
    parser.add_argument("--num-prompts", type=int, metavar="N",
                        help="use this many requests, cycling through the workload if needed")
    parser.add_argument("--seed", type=int, default=0, help="for random prompts and Poisson arrivals")


def _source(args: argparse.Namespace) -> list[BenchRequest] | RandomPrompts:
    if args.workload is not None:
        return load_workload(args.workload)
    return RandomPrompts(
        count=args.random_prompts, input_len=args.random_input_len, output_len=args.random_output_len, seed=args.seed
    )


def _source_description(args: argparse.Namespace) -> dict[str, Any]:
    if args.workload is not None:
        return {"workload": args.workload}
    return {"random_prompts": dataclasses.asdict(_source(args))}


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    from ember_bench.report import serve_table, write_json
    from ember_bench.serve import ServeConfig, run_serve
    from ember_bench.stats import parse_slos

    config = ServeConfig(
        base_url=args.base_url, model=args.model, api_key=args.api_key, concurrency=args.concurrency,
        request_rate=args.request_rate, ignore_eos=args.ignore_eos, timeout_s=args.timeout, seed=args.seed,
        slos=parse_slos(args.goodput),
    )
    source = _source(args)
    requests = take(source.words() if isinstance(source, RandomPrompts) else source, args.num_prompts)
    run = asyncio.run(run_serve(config, requests))
    print(serve_table(run.model, run.metrics, config.slos, run.preemptions))
    if args.output_json:
        settings = {k: v for k, v in dataclasses.asdict(config).items() if k != "api_key"}
        write_json(args.output_json, {
            "benchmark": "serve", "timestamp": _now(), **_source_description(args), "num_requests": len(requests),
            "config": {**settings, "model": run.model}, "metrics": run.metrics, "preemptions": run.preemptions,
        })
    return 0 if run.metrics.completed else 1


def _routing(args: argparse.Namespace) -> int:
    import shlex

    from ember_bench.conversations import load_conversations
    from ember_bench.report import write_json
    from ember_bench.routing import RoutingSetup, routing_table, run_routing

    setup = RoutingSetup(
        model=args.model, data_parallel_size=args.data_parallel_size, extra_serve_args=tuple(shlex.split(args.serve_args)),
        timeout_s=args.timeout, concurrency=args.concurrency, user_rates=_rates(args.user_rate), seed=args.seed,
    )
    workload = load_conversations(args.workload)
    runs = []
    for run in run_routing(setup, workload, _names(args.routing)):
        runs.append(run)
        print(routing_table([run]).splitlines()[-1], file=sys.stderr, flush=True)
    print(routing_table(runs))
    if args.output_json:
        write_json(args.output_json, {
            "benchmark": "routing", "timestamp": _now(), "workload": args.workload, "config": setup,
            "runs": [{**dataclasses.asdict(run), "computed_tokens": run.computed_tokens} for run in runs],
        })
    return 0 if all(run.failed == 0 for run in runs) else 1


def _abuse(args: argparse.Namespace) -> int:
    import shlex

    from ember_bench.abuse import AbuseSetup, abuse_summary, run_abuse
    from ember_bench.report import write_json

    setup = AbuseSetup(
        model=args.model, slow_connections=args.slow_connections, idle_connections=args.idle_connections,
        slow_bodies=args.slow_bodies, storm_requests=args.storm_requests, soak_s=args.soak,
        soak_concurrency=args.soak_concurrency, rounds=args.rounds, serve_args=tuple(shlex.split(args.serve_args)),
    )
    report = run_abuse(setup)
    print(abuse_summary(report))
    if args.output_json:
        write_json(args.output_json, {"benchmark": "abuse", "timestamp": _now(), **dataclasses.asdict(report)})
    soaks = [round_.phases["soak"] for round_ in report.rounds]
    return 0 if all(soak["lost"] == 0 and soak["http_error"] == 0 for soak in soaks) else 1


def _offline(args: argparse.Namespace) -> int:
    from ember_bench.offline import OfflineConfig, environment, run_offline
    from ember_bench.offline_runs import EngineSetting, OfflineRun, settings_to_compare
    from ember_bench.report import OFFLINE_HEADER, offline_row, offline_table, write_json

    config = OfflineConfig(
        model=args.model,
        settings=settings_to_compare(
            EngineSetting(
                batching=args.batching,
                admission=args.admission,
                dtype=args.dtype,
                gguf_weights=args.gguf_weights,
                prefix_caching=args.enable_prefix_caching,
                structured_outputs=args.structured_outputs,
                numerics=args.numerics,
            ),
            _names(args.compare),
        ),
        concurrencies=_ints(args.concurrency, "--concurrency"),
        engine_kwargs={name: getattr(args, name) for name in ENGINE_FLAGS},
        transformers=args.transformers,
        num_prompts=args.num_prompts,
        rounds=args.rounds,
    )
    runs: list[OfflineRun] = []
    print(OFFLINE_HEADER, file=sys.stderr)
    try:
        for run in run_offline(config, _source(args)):
            runs.append(run)
            print(offline_row(run), file=sys.stderr, flush=True)
    finally:
        # A long sweep that fails or is interrupted late still leaves the runs it finished.
        if runs and args.output_json:
            write_json(args.output_json, {
                "benchmark": "offline", "timestamp": _now(), **_source_description(args), "config": config,
                "environment": environment(), "runs": [{"name": run.name, **dataclasses.asdict(run)} for run in runs],
            })
        if runs and args.plot:
            from ember_bench.plot import plot_offline

            plot_offline(runs, args.plot, f"ember bench offline: {args.model}")
    print(offline_table(runs))
    if "dtype" in _names(args.compare):
        from ember_bench.dtype_rows import dtype_verdicts

        print("\n".join(["", *dtype_verdicts(runs)]))
    return 0


def _make_model(args: argparse.Namespace) -> int:
    from ember_bench.gguf_export import FILE_TYPES, export_gguf
    from ember_bench.random_models import random_checkpoint

    unknown = [file_type for file_type in args.gguf if file_type not in FILE_TYPES]
    if unknown:
        raise ValueError(f"--gguf {unknown[0]!r} is not a GGUF type; supported: {', '.join(FILE_TYPES)}")
    overrides = {}
    for item in args.set:
        key, separator, value = item.partition("=")
        if not separator or not key:
            raise ValueError(f"--set takes KEY=VALUE, got {item!r}")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    model_dir = random_checkpoint(args.family, Path(args.out), preset=args.preset, seed=args.seed, **overrides)
    print(f"wrote {model_dir}")
    for file_type in args.gguf:
        print(f"wrote {export_gguf(model_dir, model_dir / f'model-{file_type}.gguf', file_type)}")
    return 0


def _tp_costs(args: argparse.Namespace) -> int:
    from ember_bench.linear_share import time_linears
    from ember_bench.parallel_sums import measure_sums, sums_table

    rows = _ints(args.rows, "--rows")
    if args.tensor_parallel_size < 2 or min([args.hidden, args.repeats, *rows]) < 1:
        raise ValueError("--tensor-parallel-size must be at least 2; --rows, --hidden and --repeats at least 1")
    print(sums_table(measure_sums(args.tensor_parallel_size, [(count, args.hidden) for count in rows], args.repeats)))
    if args.model:
        share = 1 - 1 / args.tensor_parallel_size
        print(f"\n{'rows':>5} {'linears':>8} {'ms a step':>10} {'ideal saving at N':>18}")
        for timing in time_linears(args.model, args.dtype, args.numerics, rows, repeats=20):
            print(f"{timing.rows:>5} {timing.linears:>8} {timing.total_ms:>10.2f} {timing.total_ms * share:>15.2f} ms")
    return 0


def _make_adapters(args: argparse.Namespace) -> int:
    from ember_bench.random_adapters import write_random_adapters

    if args.rank < 1:
        raise ValueError(f"--rank must be at least 1, got {args.rank}")
    outs = [Path(out) for out in args.out]
    write_random_adapters(args.model, outs, args.rank, _names(args.targets), args.seed)
    print("wrote " + " ".join(map(str, outs)))
    return 0


def _kernels(args: argparse.Namespace) -> int:
    import torch

    from ember_bench.kernels import (
        FORMATS,
        attention_timings,
        decode_layer_timings,
        kernel_table,
        linear_timings,
        measure_peak,
        peak_summary,
    )
    from ember_bench.offline import environment
    from ember_bench.report import write_json
    from ember_core.kernels import cpu_ops

    forms = tuple(_names(args.formats))
    if unknown := [form for form in forms if form not in FORMATS]:
        raise ValueError(f"--formats {unknown[0]!r} is not one of {', '.join(FORMATS)}")
    dtypes = tuple(_names(args.dtypes))
    if unknown := [name for name in dtypes if name not in ("float32", "bfloat16")]:
        raise ValueError(f"--dtypes {unknown[0]!r} is not float32 or bfloat16")
    if not cpu_ops.is_available():
        raise ValueError(f"ember's C++ CPU ops are not available here: {cpu_ops.unavailable_reason()}")
    peak = measure_peak()
    print(peak_summary(peak), flush=True)
    timings = []
    runs = [
        linear_timings(forms, tuple(_ints(args.rows, "--rows")), tuple(getattr(torch, name) for name in dtypes),
                       args.repeats, args.layers),
        attention_timings(tuple(_ints(args.batches, "--batches")), args.context, args.repeats, args.layers),
        decode_layer_timings(tuple(getattr(torch, name) for name in dtypes), rows=16),
    ]
    for run in runs:
        for timing in run:
            timings.append(timing)
            print(kernel_table([timing], peak).splitlines()[-1], file=sys.stderr, flush=True)
    print(kernel_table(timings, peak))
    if args.output_json:
        write_json(args.output_json, {
            "benchmark": "kernels", "timestamp": _now(), "environment": environment(), "peak": peak,
            "timings": [{**dataclasses.asdict(t), "gflops": t.gflops, "gbps": t.gbps} for t in timings],
        })
    return 0


def _determinism(args: argparse.Namespace) -> int:
    from ember_bench.determinism import DeterminismConfig, determinism_table, run_determinism
    from ember_bench.offline import environment
    from ember_bench.report import write_json

    config = DeterminismConfig(
        model=args.model, dtype=args.dtype, numerics=args.numerics, prompts=args.prompts, replays=args.replays,
        max_tokens=args.max_tokens, seed=args.seed,
    )
    report = run_determinism(config)
    print(determinism_table(report))
    if args.output_json:
        write_json(args.output_json, {
            "benchmark": "determinism", "timestamp": _now(), "environment": environment(), "config": config,
            "report": report, "tokens_per_s": report.tokens_per_s, "deterministic": report.deterministic,
        })
    return 0 if report.deterministic else 1


def _fidelity(args: argparse.Namespace) -> int:
    import tempfile

    import torch

    from ember_bench.fidelity import FIDELITY_HEADER, TEXT, compare, fidelity_row
    from ember_bench.llama_cpp_fidelity import llama_cpp_fidelity
    from ember_bench.offline import environment
    from ember_bench.report import write_json
    from ember_core.layers.kv_quant import QUANTIZED_KV_DTYPES, kv_cache_dtype
    from ember_core.loaders.load import load_model
    from ember_core.loaders.resolve import resolve_model

    if args.context < 4:
        raise ValueError(f"--context must be at least 4 tokens, got {args.context}")
    if args.llama_cpp_dir and args.kv_cache_dtype and args.kv_cache_dtype not in QUANTIZED_KV_DTYPES:
        raise ValueError("--llama-cpp-dir measures llama.cpp's q8_0 K/V: give --kv-cache-dtype int8 or fp8_e4m3")
    text = Path(args.text) if args.text else TEXT
    content = text.read_text()
    device = torch.device("cpu")
    tested = load_model(args.model, device, getattr(torch, args.dtype), numerics=args.numerics)
    kv_dtype = kv_cache_dtype(args.kv_cache_dtype, getattr(torch, args.dtype), device) if args.kv_cache_dtype else None
    reference = tested if kv_dtype else load_model(args.model, device, torch.float32, numerics="exact")
    if reference.tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer to cut the text into tokens")
    tokenizer = reference.tokenizer
    tokens = tokenizer.encode(content)
    bos = tokenizer.bos_token_id if tokenizer.add_bos_token else None
    name = f"ember {tested.numerics} {args.dtype}" + (f", {args.kv_cache_dtype} K/V" if kv_dtype else "")
    print(f"{args.model}: {len(tokens)} tokens of {text.name}, windows of {args.context}", file=sys.stderr)
    print(FIDELITY_HEADER)
    ember = compare(reference.model, tested.model, tokens, args.context, args.max_windows, bos, kv_dtype)
    print(fidelity_row(name, ember), flush=True)
    report = {"benchmark": "fidelity", "timestamp": _now(), "environment": environment(), "model": args.model,
              "context": args.context, "tokens": len(tokens), name: ember}
    if args.llama_cpp_dir:
        with tempfile.TemporaryDirectory() as workdir:
            llama = llama_cpp_fidelity(Path(args.llama_cpp_dir), resolve_model(args.model), text, args.context,
                                       torch.get_num_threads(), Path(workdir), args.max_windows, kv_cache_q8_0=bool(kv_dtype))
        llama_name = "llama.cpp, q8_0 K/V" if kv_dtype else "llama.cpp"
        print(fidelity_row(llama_name, llama))
        report[llama_name] = llama
    if args.output_json:
        write_json(args.output_json, report)
    return 0


def _context(args: argparse.Namespace) -> int:
    from ember_bench.context_costs import run
    from ember_bench.report import write_json

    costs = run(args.url, args.short, args.long, args.turn, args.output, args.rounds)
    print(costs.report())
    if args.output_json:
        write_json(Path(args.output_json), costs.as_json())
    return 0


def _families(args: argparse.Namespace) -> int:
    from ember_bench.family_steps import SHAPE, run_families
    from ember_bench.offline import environment
    from ember_bench.report import write_json
    from ember_core.auto_dtype import requested_dtype
    from ember_core.device import resolve_device

    device = resolve_device("cpu")
    names = _names(args.families)
    print(f"decode step at batch {args.batch}, {args.prompt_len}-token contexts, {args.type} GGUF, {args.dtype}; "
          f"shape {SHAPE}", file=sys.stderr)
    print("| family | step ms (median of rounds) | x first | rounds ms |\n|---|---|---|---|", file=sys.stderr)
    steps = []
    for step in run_families(names, args.type, requested_dtype(args.dtype, device), args.dtype, args.batch,
                             args.prompt_len, args.steps, args.rounds, device):
        steps.append(step)
        rounds = ", ".join(f"{ms:.1f}" for ms in step.rounds_ms)
        print(f"| {step.family} | {step.step_ms:.1f} | {step.ratio_to(steps[0]):.2f} | {rounds} |", file=sys.stderr)
    if args.output_json:
        options = {name: value for name, value in vars(args).items() if not callable(value)}
        write_json(args.output_json, {
            "benchmark": "families", "timestamp": _now(), "config": {**options, "shape": SHAPE},
            "environment": environment(), "steps": [dataclasses.asdict(step) for step in steps],
        })
    return 0


def _moe(args: argparse.Namespace) -> int:
    from ember_bench.moe_steps import DENSE_PRESET, MOE_PRESET, run_moe_steps
    from ember_bench.offline import environment
    from ember_bench.report import write_json
    from ember_core.auto_dtype import requested_dtype
    from ember_core.device import resolve_device

    device = resolve_device("cpu")
    print(f"{MOE_PRESET} against {DENSE_PRESET}: decode steps after {args.prompt_len}-token prompts, {args.type} GGUF, "
          f"{args.dtype}, {args.rounds} rounds", file=sys.stderr)
    print("| batch | MoE step ms | dense step ms | x dense | experts a layer ran | experts' MB read a step | "
          "all experts' MB | per-token MB |\n|---|---|---|---|---|---|---|---|")
    steps = []
    for step in run_moe_steps(args.type, requested_dtype(args.dtype, device), args.dtype, _ints(args.batches, "--batches"),
                              args.prompt_len, args.steps, args.rounds, device):
        steps.append(step)
        print(f"| {step.batch} | {step.moe_ms:.1f} | {step.dense_ms:.1f} | {step.ratio:.2f} | {step.experts_per_layer:.1f} | "
              f"{step.expert_mb_read:.0f} | {step.all_experts_mb:.0f} | {step.per_token_mb:.0f} |", flush=True)
    if args.output_json:
        options = {name: value for name, value in vars(args).items() if not callable(value)}
        write_json(args.output_json, {
            "benchmark": "moe", "timestamp": _now(), "config": options, "environment": environment(),
            "steps": [{**dataclasses.asdict(step), "ratio": step.ratio} for step in steps],
        })
    return 0


def _export_gguf(args: argparse.Namespace) -> int:
    from ember_bench.gguf_export import export_gguf

    print(f"wrote {export_gguf(Path(args.model_dir), Path(args.out), args.type)}")
    return 0


def _names(spec: str) -> list[str]:
    return [name.strip() for name in spec.split(",") if name.strip()]


def _ints(spec: str, flag: str) -> list[int]:
    try:
        return [int(value) for value in _names(spec)]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {spec!r}") from None


def _rates(spec: str) -> tuple[float | None, ...]:
    try:
        rates = tuple(None if name == "all" else float(name) for name in _names(spec))
    except ValueError:
        raise ValueError(f"--user-rate must be comma-separated numbers or 'all', got {spec!r}") from None
    if not rates or any(rate is not None and not rate > 0 for rate in rates):
        raise ValueError(f"--user-rate must be positive numbers or 'all', got {spec!r}")
    return rates


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
