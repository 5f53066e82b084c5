"""Load test for serve.py: streaming /v1/completions requests at Poisson arrival rates (open loop) or from N
concurrent streams (closed loop), against a server on this machine.

    python serve.py --quiet &
    python loadtest.py --rates 1 4 --concurrency 1 16 --requests 32 --max-tokens 64

Per request: TTFT (from sending it to the first content chunk) and TPOT ((last content chunk - first) / (completion
tokens - 1), the count from the stream's usage chunk). Per load point: output tokens/s over the wall time, and
p50/p95/p99 of TTFT and TPOT computed from the samples. Prompts are slices of varied length of
data/pride_and_prejudice_ch1-2.txt, fresh for each load point; prompts and arrival times come from generators
seeded per load point (--seed), so two servers (continuous vs --static-batching) get the same load.
"""
import argparse
import asyncio
import ipaddress
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

from cli import Range, check_output_file, check_ranges, run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = os.path.join(ROOT, "data", "pride_and_prejudice_ch1-2.txt")


@dataclass
class Result:
    """One request: ok, or the error; its times in seconds (None when there was no such chunk)."""
    ok: bool
    error: str | None = None
    start_s: float = 0.0  # time.perf_counter() when sent
    end_s: float = 0.0
    ttft_s: float | None = None
    tpot_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


def percentile(samples: list[float], q: float) -> float:
    """The q-th percentile (0..100) of samples, linear between the closest ranks (numpy's default); nan if none."""
    xs = sorted(samples)
    if not xs:
        return math.nan
    k = (len(xs) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def check_loopback(url: str) -> str:
    """The URL without a trailing slash; a ValueError unless it is http(s) to this machine."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"--url must be http://HOST:PORT, got {url!r}")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"--url host {host!r} is not this machine; the load test only targets loopback "
                         "(127.0.0.1, ::1, localhost)")
    return url.rstrip("/")


def make_prompts(n: int, min_words: int, max_words: int, rng: random.Random) -> list[str]:
    """n slices of the text, each min_words..max_words words long from a random word."""
    with open(TEXT, encoding="utf-8") as f:
        words = f.read().split()
    if not 1 <= min_words <= max_words <= len(words):
        raise ValueError(f"need 1 <= --min-words <= --max-words <= {len(words)} (the text's words), "
                         f"got {min_words} and {max_words}")
    prompts = []
    for _ in range(n):
        length = rng.randint(min_words, max_words)
        start = rng.randint(0, len(words) - length)
        prompts.append(" ".join(words[start:start + length]))
    return prompts


async def one_request(client, url: str, model: str, prompt: str, max_tokens: int,
                      ignore_eos: bool = False, arrivals: list[float] | None = None) -> Result:
    """Send one streaming completion (greedy, fixed max_tokens; ignore_eos: all of them, as vLLM's and llama.cpp's
    servers take it too) and time its content chunks (each one's time.perf_counter() appended to `arrivals`)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **({"ignore_eos": True} if ignore_eos else {})}
    r = Result(ok=False, start_s=time.perf_counter())
    first = last = None
    used = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                r.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:200]}"
                return r
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    r.error = f"stream error: {chunk['error'].get('message')}"
                    return r
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    last = time.perf_counter()
                    first = first or last
                    if arrivals is not None:
                        arrivals.append(last)
                if chunk.get("usage"):
                    used = chunk["usage"]
    except Exception as e:  # a failed request is a result to count, not the end of the run
        r.error = f"{type(e).__name__}: {e}"
        return r
    finally:
        r.end_s = time.perf_counter()
    if used is None:
        r.error = "the stream ended without a usage chunk"
        return r
    r.ok = True
    r.prompt_tokens, r.completion_tokens = used["prompt_tokens"], used["completion_tokens"]
    if first is not None:
        r.ttft_s = first - r.start_s
        if r.completion_tokens > 1:
            r.tpot_s = (last - first) / (r.completion_tokens - 1)
    return r


async def open_loop(client, url: str, model: str, prompts: list[str], max_tokens: int, rate: float,
                    rng: random.Random, deadline: float, ignore_eos: bool = False) -> list[asyncio.Task]:
    """Send the prompts at Poisson arrivals of `rate` requests/s (exponential gaps), not waiting for answers;
    none after the deadline."""
    tasks, t = [], time.perf_counter()
    for prompt in prompts:
        if t > deadline:
            break
        await asyncio.sleep(max(0.0, t - time.perf_counter()))
        tasks.append(asyncio.create_task(one_request(client, url, model, prompt, max_tokens, ignore_eos)))
        t += rng.expovariate(rate)
    return tasks


async def closed_loop(client, url: str, model: str, prompts: list[str], max_tokens: int, concurrency: int,
                      results: list[Result], ignore_eos: bool = False) -> None:
    """`concurrency` streams, each sending its next prompt as soon as its previous answer is complete; appends
    to results as they come."""
    todo = iter(prompts)

    async def stream() -> None:
        for prompt in todo:  # the streams share one iterator: each prompt is sent once
            results.append(await one_request(client, url, model, prompt, max_tokens, ignore_eos))

    await asyncio.gather(*(stream() for _ in range(concurrency)))


async def load_point(client, args: argparse.Namespace, model: str, mode: str, value: float,
                     rng: random.Random) -> dict:
    """Run one load point (mode "rate" or "concurrency") with prompts and arrival times drawn from rng; its
    summary, with the samples. Requests not done by --timeout-s are cancelled (which closes their connections:
    the server aborts them) and count as failed."""
    # Fresh prompts per load point: the same ones again would be prefix-cache hits.
    prompts = make_prompts(args.requests, args.min_words, args.max_words, rng)
    t0 = time.perf_counter()
    deadline = t0 + args.timeout_s
    results: list[Result] = []
    if mode == "rate":
        tasks = await open_loop(client, args.url, model, prompts, args.max_tokens, value, rng, deadline,
                                args.ignore_eos)
        done, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)  # let the cancelled ones close their connections
        results = [t.result() for t in done]
    else:
        try:
            await asyncio.wait_for(closed_loop(client, args.url, model, prompts, args.max_tokens, int(value),
                                               results, args.ignore_eos), args.timeout_s)
        except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
            pass
    wall = time.perf_counter() - t0
    results += [Result(ok=False, error="timeout") for _ in range(len(prompts) - len(results))]
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    tokens = sum(r.completion_tokens for r in ok)
    errors = sorted({r.error for r in results if not r.ok})
    return {"mode": mode, "value": value, "ok": len(ok), "failed": len(results) - len(ok), "wall_s": wall,
            "output_tokens": tokens, "output_tokens_per_s": tokens / wall, "requests_per_s": len(ok) / wall,
            "mean_prompt_tokens": sum(r.prompt_tokens for r in ok) / len(ok) if ok else math.nan,
            **{f"ttft_p{q}_s": percentile(ttft, q) for q in (50, 95, 99)},
            **{f"tpot_p{q}_s": percentile(tpot, q) for q in (50, 95, 99)},
            "errors": errors[:5], "samples": [asdict(r) for r in results]}


def table(points: list[dict]) -> str:
    """The load points as a markdown table (times in ms)."""
    head = ("| load | ok | failed | wall s | output tok/s | req/s | TTFT p50 / p95 / p99 ms | "
            "TPOT p50 / p95 / p99 ms |\n|---|---|---|---|---|---|---|---|")

    def ms(p: dict, key: str) -> str:
        return " / ".join(f"{p[f'{key}_p{q}_s'] * 1000:.0f}" for q in (50, 95, 99))

    rows = []
    for p in points:
        load = f"{p['value']:g} req/s Poisson" if p["mode"] == "rate" else \
            f"{p['value']:g} concurrent stream{'s' if p['value'] != 1 else ''}"
        rows.append(f"| {load} | {p['ok']} | {p['failed']} | {p['wall_s']:.1f} | {p['output_tokens_per_s']:.1f} | "
                    f"{p['requests_per_s']:.2f} | {ms(p, 'ttft')} | {ms(p, 'tpot')} |")
    return "\n".join([head, *rows])


def http():
    """The HTTP client's module: the maintained HTTPX (httpx2, which the openai client depends on) when installed."""
    try:
        import httpx2 as httpx
    except ImportError:
        import httpx
    return httpx


def http_client(connections: int, timeout_s: float, api_key: str | None = None):
    """An async client with room for `connections` requests at once, each given timeout_s."""
    httpx = http()
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits, headers=headers)


async def measure(args: argparse.Namespace) -> tuple[str, list[dict]]:
    """The served model's name and every load point's summary (progress on stderr)."""
    httpx = http()
    async with http_client(args.requests + 1, args.timeout_s, args.api_key) as client:
        try:
            models = await client.get(f"{args.url}/v1/models")
        except httpx.TransportError as e:
            raise ValueError(f"no server at {args.url} ({type(e).__name__}); start one with python serve.py") from None
        if models.status_code != 200:  # e.g. 401: the server wants --api-key
            raise ValueError(f"{args.url}/v1/models answered HTTP {models.status_code}: {models.text[:200]}")
        model = models.json()["data"][0]["id"]
        # Not measured: first-call costs (allocation, lazy initialization) on the server.
        for prompt in make_prompts(args.warmup, args.min_words, args.max_words, random.Random(f"{args.seed}:warmup")):
            await one_request(client, args.url, model, prompt, args.max_tokens)
        points = []
        loads = [("rate", r) for r in args.rates or []] + [("concurrency", n) for n in args.concurrency or []]
        for i, (mode, value) in enumerate(loads):
            # Seeded per load point: every server under test gets the same prompts and arrival times.
            points.append(await load_point(client, args, model, mode, value, random.Random(f"{args.seed}:{i}")))
            p = points[-1]
            print(f"{mode} {value:g}: {p['ok']} ok, {p['failed']} failed, {p['output_tokens_per_s']:.1f} "
                  f"output tok/s{' | errors: ' + '; '.join(p['errors']) if p['errors'] else ''}", file=sys.stderr)
    return model, points


async def run_async(args: argparse.Namespace) -> list[dict]:
    model, points = await measure(args)
    print(f"model {model} | {args.requests} requests per load point | max_tokens {args.max_tokens} | prompts "
          f"{args.min_words}-{args.max_words} words | seed {args.seed}\n")
    print(table(points))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"url": args.url, "model": model, "requests": args.requests, "max_tokens": args.max_tokens,
                       "min_words": args.min_words, "max_words": args.max_words, "seed": args.seed,
                       "points": points}, f, indent=1)
    return points


# Each numeric flag's allowed values (cli.check_ranges), checked before any request is sent.
RANGES = {"rates": Range(0, 1e6, above=True), "concurrency": Range(1, 10_000), "requests": Range(1, 10**6),
          "max_tokens": Range(1, 2**20), "min_words": Range(1, 10**6), "max_words": Range(1, 10**6),
          "seed": Range(-2**63, 2**64 - 1), "warmup": Range(0, 10_000), "timeout_s": Range(0, 7 * 86400, above=True)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m scripts.loadtest", description="Load-test serve.py: streaming completions at Poisson "
        "arrival rates and/or N concurrent closed-loop streams; prints a markdown table.")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (loopback only)")
    p.add_argument("--rates", type=float, nargs="+", default=None, metavar="R",
                   help="open loop: Poisson arrivals at R requests/s, one load point per R")
    p.add_argument("--concurrency", "--concurrency-sweep", type=int, nargs="+", default=None, metavar="N",
                   help="closed loop: N concurrent streams, one load point per N")
    p.add_argument("--requests", type=int, default=32, help="requests per load point")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (greedy)")
    p.add_argument("--ignore-eos", action="store_true", help="generate all --max-tokens (vLLM's ignore_eos)")
    p.add_argument("--min-words", type=int, default=16, help="shortest prompt, in words of the text")
    p.add_argument("--max-words", type=int, default=256, help="longest prompt, in words of the text")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts and the arrival times")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests before the first load point")
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="per load point: requests still running then are cancelled and counted as failed")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results and samples to FILE")
    p.add_argument("--api-key", default=os.environ.get("TINYLLM_API_KEY"), metavar="KEY",
                   help="the server's --api-key (default: $TINYLLM_API_KEY)")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def run(args: argparse.Namespace) -> None:
    check_ranges(args, RANGES)
    check_output_file(args.json, "--json")
    args.url = check_loopback(args.url)
    if not args.rates and not args.concurrency:
        raise ValueError("nothing to run: pass --rates R [R ...] and/or --concurrency N [N ...]")
    asyncio.run(run_async(args))


def main(argv: list[str] | None = None) -> int:

    return run_cli(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
