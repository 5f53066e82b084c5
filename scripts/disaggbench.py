"""Disaggregated prefill/decode against co-located serving at the same cores: serve.py with --threads 2 on two cores
(chunked prefill), then a decode worker and a prefill worker (serve.py --role decode / --role prefill) with one
thread and one core each, under the same load: --streams closed-loop greedy streams, and a long prompt (different
each time: no prefix-cache hits) arriving every --long-every seconds. Prints, per mode, the running streams'
inter-token latency (gaps between streamed tokens) p50/p99, TTFT of the streams and of the long prompts, output
tokens/s, and the KV bytes the decode worker received per request and per prompt token.

    python -m scripts.disaggbench --streams 4 --long-every 8 --long-words 300 --duration 60
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time

from cli import Range, check_ranges, default_model, run_cli
from scripts.loadtest import percentile
from scripts.servebench import wait_ready

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = os.path.join(ROOT, "data", "pride_and_prejudice_ch1-2.txt")
MODES = ("colocated", "colocated-1thread", "disagg")


def start(args: argparse.Namespace, flags: list[str], cores: set[int], log, threads: int = 1) -> subprocess.Popen:
    """serve.py with flags and this many threads, pinned to cores."""
    argv = [sys.executable, "serve.py", "--model", args.model, "--quiet", "--threads", str(threads), *flags,
            *(["--dtype", args.dtype] if args.dtype else [])]
    return subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": str(threads)},
                            preexec_fn=lambda: os.sched_setaffinity(0, cores))


def stream(url: str, body: dict, on_token) -> int:
    """One streamed greedy completion; on_token(time) at each chunk with text; returns the prompt's tokens (0 if
    refused)."""
    import httpx

    prompt_tokens = 0
    body = {**body, "stream": True, "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            print(f"disaggbench: the server answered {r.status_code}: {r.read().decode()[:200]}", file=sys.stderr)
            return 0
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["text"]:
                on_token(time.perf_counter())
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
    return prompt_tokens


def load(url: str, args: argparse.Namespace, words: list[str]) -> dict:
    """The load: closed-loop streams and periodic long prompts for args.duration seconds, then up to args.grace
    seconds for those in flight; the samples, counted as the tokens arrive (a request still running at the end
    gives the gaps it had)."""
    import httpx

    out = {"itl": [], "stream_ttft": [], "long_ttft": [], "tokens": 0, "requests": 0, "prompt_tokens": 0,
           "unfinished": 0}
    lock, end = threading.Lock(), time.perf_counter() + args.duration

    def request(prompt: str, max_tokens: int, kind: str) -> None:
        t0, last = time.perf_counter(), []

        def on_token(t: float) -> None:
            with lock:
                if not last:
                    out[f"{kind}_ttft"].append(t - t0)
                elif kind == "stream":
                    out["itl"].append(t - last[0])
                last[:] = [t]
                out["tokens"] += 1

        with lock:
            out["unfinished"] += 1
        try:
            prompt_tokens = stream(url, {"prompt": prompt, "max_tokens": max_tokens}, on_token)
        except httpx.HTTPError:  # cut off at the end (the server stopped)
            return
        with lock:
            out["unfinished"] -= 1
            out["requests"] += 1
            out["prompt_tokens"] += prompt_tokens

    def streamer(i: int) -> None:
        n = 0
        while time.perf_counter() < end:
            request(f"Stream {i}.{n}: " + " ".join(words[(i * 50 + n * 7) % 1000:][:40]), args.stream_tokens,
                    "stream")
            n += 1

    threads = [threading.Thread(target=streamer, args=(i,), daemon=True) for i in range(args.streams)]
    for t in threads:
        t.start()
    k = 0
    while time.perf_counter() + args.long_every < end:
        time.sleep(args.long_every)
        prompt = f"Document {k}: " + " ".join((words * 3)[(k * 131) % 1000:][:args.long_words])
        threads.append(threading.Thread(target=request, args=(prompt, args.long_tokens, "long"), daemon=True))
        threads[-1].start()
        k += 1
    for t in threads:
        t.join(timeout=max(0.0, end + args.grace - time.perf_counter()))
    with lock:  # (requests cut off go on adding to out)
        return {**{k: list(v) if isinstance(v, list) else v for k, v in out.items()},
                "seconds": time.perf_counter() - end + args.duration}


def kv_received(url: str) -> int:
    import httpx

    return httpx.get(f"{url}/health", timeout=10).json()["engine"].get("kv_bytes_received", 0)


def measure(args: argparse.Namespace, mode: str, words: list[str]) -> dict:
    """Start mode's processes, warm up, run the load, stop them."""
    url, kv = f"http://127.0.0.1:{args.port}", f"127.0.0.1:{args.port + 1}"
    c0, c1 = args.cores
    with open(os.path.join(args.logs, f"disaggbench-{mode}.log"), "w") as log:
        if mode.startswith("colocated"):  # colocated-1thread: one OpenMP thread, either core
            procs = [start(args, ["--port", str(args.port)], {c0, c1}, log, 1 if mode != "colocated" else 2)]
        else:
            procs = [start(args, ["--port", str(args.port), "--role", "decode", "--kv-address", kv], {c0}, log),
                     start(args, ["--role", "prefill", "--kv-address", kv], {c1}, log)]
        try:
            wait_ready(url, procs[0], 300)
            stream(url, {"prompt": "Warm-up: " + " ".join(words[:args.long_words]), "max_tokens": 4}, lambda t: None)
            before = kv_received(url)
            result = load(url, args, words)
            result["kv_bytes"] = kv_received(url) - before
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(timeout=60)
    return result


def table(results: dict[str, dict]) -> str:
    rows = ["| mode | ITL p50 / p99 ms | stream TTFT p50 / p99 ms | long-prompt TTFT p50 / p99 ms | output tok/s | "
            "KV MB per request | KV KB per prompt token | cut off |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, r in results.items():
        ms = lambda xs: f"{percentile(xs, 50) * 1000:.0f} / {percentile(xs, 99) * 1000:.0f}"  # noqa: E731
        kv = r["kv_bytes"]
        rows.append(f"| {mode} | {ms(r['itl'])} | {ms(r['stream_ttft'])} | {ms(r['long_ttft'])} | "
                    f"{r['tokens'] / r['seconds']:.1f} | {kv / max(r['requests'], 1) / 1e6:.2f} | "
                    f"{kv / max(r['prompt_tokens'], 1) / 1e3:.1f} | {r['unfinished']} |")
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="ITL and TTFT of co-located vs disaggregated prefill/decode serving, "
                                "at the same cores, while long prompts arrive among running streams.")
    p.add_argument("--model", default=None, help="as serve.py's (default: the SmolLM2 GGUF)")
    p.add_argument("--dtype", default=None, help="as serve.py's (default: its auto)")
    p.add_argument("--modes", nargs="+", default=["colocated", "disagg"], choices=MODES,
                   help="colocated: one process, 2 threads on the 2 cores; colocated-1thread: one thread, either "
                   "core; disagg: a decode and a prefill worker, 1 thread and 1 core each (default colocated disagg)")
    p.add_argument("--cores", nargs=2, type=int, default=None, metavar=("A", "B"),
                   help="the two CPU cores (default: the first two this process may use)")
    p.add_argument("--streams", type=int, default=4, help="closed-loop greedy streams (default 4)")
    p.add_argument("--stream-tokens", type=int, default=64, help="tokens per stream request (default 64)")
    p.add_argument("--long-every", type=float, default=8.0, help="seconds between long prompts (default 8)")
    p.add_argument("--long-words", type=int, default=300, help="words per long prompt (default 300, ~400 tokens)")
    p.add_argument("--long-tokens", type=int, default=8, help="tokens generated per long prompt (default 8)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load per mode (default 60)")
    p.add_argument("--grace", type=float, default=30.0,
                   help="seconds the requests in flight at the end may take before the mode is cut off (default 30)")
    p.add_argument("--port", type=int, default=8300, help="the HTTP port; the KV link takes the next (default 8300)")
    p.add_argument("--logs", default=".", help="folder for each mode's server log (default .)")
    p.add_argument("--json", default=None, metavar="FILE", help="write every sample here")
    return p


def run(args: argparse.Namespace) -> None:
    check_ranges(args, {"streams": Range(1, 256), "stream_tokens": Range(2, 4096),
                        "long_every": Range(0, 3600, above=True), "long_words": Range(1, 2000),
                        "long_tokens": Range(1, 4096),
                        "duration": Range(0, 86400, above=True), "grace": Range(0, 86400), "port": Range(1, 65534)})
    allowed = sorted(os.sched_getaffinity(0))
    args.cores = args.cores or allowed[:2]
    if len(set(args.cores)) != 2 or not set(args.cores) <= set(allowed):
        raise ValueError(f"--cores needs two different cores of {allowed}")
    args.model = args.model or default_model()
    with open(TEXT, encoding="utf-8") as f:
        words = f.read().split()
    results = {mode: measure(args, mode, words) for mode in args.modes}
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
