"""Disaggregated prefill/decode (serving/disagg.py) against the co-located engine: a decode worker fed by a prefill
worker over a real socket gives the co-located engine's tokens (greedy, sampled, n/best_of, logprobs) for 16
concurrent requests, with prefix-cache hits on either side and preemption; a prefill worker lost mid-transfer, silent
or refused fails only its requests, the decode worker serves on (503 while none is connected) and a new worker is
served exactly; the wire's block packing round-trips. The fast tests run the worker on a thread of this process;
the slow ones run `serve.py --role prefill` and `--role decode` as two processes over HTTP."""
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from helpers import ROOT, ToyTokenizer, stop_server
from kvcache import BlockPool
from params import SamplingParams
from serving import disagg
from serving.contract import Request, Unavailable
from serving.disagg import DecodeEngine, PrefillWorker
from serving.engine import Engine, EngineConfig
from step import Step
from tiny_models import greedy_ids

LENGTHS = [3, 17, 40, 9, 33, 64, 5, 21, 50, 12, 100, 2, 77, 8, 130, 45]  # 16 prompts, 2 to 130 tokens
ROOMY = EngineConfig(block_size=4, num_blocks=300, max_running=16, token_budget=24)
PREFILL = EngineConfig(block_size=4, num_blocks=300, token_budget=16)


def random_prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 160, (n,), generator=g).tolist() for n in lengths]


class Worker:
    """A PrefillWorker dialling `engine` from a thread of this process (a real socket), until stopped."""

    def __init__(self, model, engine: DecodeEngine, config: EngineConfig = PREFILL, **kwargs):
        self.worker = PrefillWorker(model, config, **kwargs)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.worker.run, args=(engine.link.address, self.stop, 0.05),
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while engine.link.connected() == 0:
            assert time.monotonic() < deadline, "the prefill worker did not connect"
            time.sleep(0.01)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        assert not self.thread.is_alive()


def wait_until(condition, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.fixture
def pair(tiny):
    """(decode engine, its prefill worker) on the tiny model, roomy pools."""
    engine = DecodeEngine(tiny, ToyTokenizer(), ROOMY)
    worker = Worker(tiny, engine)
    yield engine, worker
    worker.close()
    engine.close()


@pytest.mark.parametrize("decode_config", [ROOMY, EngineConfig(block_size=4, num_blocks=60, max_running=16,
                                                                 token_budget=24)], ids=["roomy", "preemption"])
def test_16_concurrent_requests_give_the_colocated_tokens(tiny, decode_config):
    """Mixed prompt lengths, all submitted at once; the second round takes the decode worker's prefix cache (less KV
    moved). With a small decode pool, preempted sequences are recomputed on the decode worker, still exact."""
    prompts = random_prompts(LENGTHS)
    want = Engine(tiny, ToyTokenizer(), ROOMY).generate(prompts, max_new_tokens=20)
    assert [c.tokens for c in want[:3]] == [greedy_ids(tiny, p, 20) for p in prompts[:3]]
    engine = DecodeEngine(tiny, ToyTokenizer(), decode_config)
    worker = Worker(tiny, engine)
    try:
        got = engine.generate(prompts, max_new_tokens=20)
        assert [c.tokens for c in got] == [c.tokens for c in want]
        assert [c.text for c in got] == [c.text for c in want]
        moved = engine.stats()["kv_bytes_received"]
        assert moved >= sum(n - 1 for n in LENGTHS) * engine.pool.bytes_per_token
        if decode_config is ROOMY:
            again = engine.generate(prompts, max_new_tokens=20)
            assert [c.tokens for c in again] == [c.tokens for c in want]
            assert engine.stats()["kv_bytes_received"] - moved < moved / 4  # most of it from the cache
            assert sum(c.prefilled for c in again) < sum(LENGTHS) / 4
        else:
            assert engine.stats()["preemptions"] > 0
        wait_until(lambda: engine.stats()["blocks_used"] == worker.worker.blocks.in_use() == 0, "blocks still held")
    finally:
        worker.close()
        engine.close()


def test_prefix_hits_on_the_prefill_worker_are_shipped(tiny, pair):
    """A second decode worker (a cold cache) behind a prefill worker that already computed these prompts: their KV
    comes from the prefill worker's cache (reported as cached tokens), and the tokens are the same."""
    engine, worker = pair
    prompts = random_prompts([70, 90, 45], seed=3)
    want = [c.tokens for c in engine.generate(prompts, max_new_tokens=12)]
    worker.close()
    cold = DecodeEngine(tiny, ToyTokenizer(), ROOMY)
    second = threading.Event()  # the same PrefillWorker (its prefix cache) now dials the cold engine
    thread = threading.Thread(target=worker.worker.run, args=(cold.link.address, second, 0.05), daemon=True)
    thread.start()
    try:
        wait_until(lambda: cold.link.connected() == 1, "no worker")
        got = cold.generate(prompts, max_new_tokens=12)
        assert [c.tokens for c in got] == want
        assert all(c.prefilled < 16 for c in got), [c.prefilled for c in got]  # the prefill worker's hits
    finally:
        second.set()
        thread.join(10)
        cold.close()


def test_sampling_parallel_choices_and_logprobs_as_colocated(tiny, pair):
    """Seeded sampling, n/best_of forks and logprobs: the first token is sampled on the decode worker, with the
    request's own generator, so every event is the co-located engine's."""
    engine, _ = pair
    prompts = random_prompts([30, 7, 55], seed=5)
    requests = [dict(params=SamplingParams(temperature=0.9, top_p=0.9), seed=11, n=2, best_of=3, logprobs=2),
                dict(params=SamplingParams(temperature=1.2, top_k=20), seed=4, n=3),
                dict(params=SamplingParams(), logprobs=1)]

    def serve(eng):
        events = {}
        ids = [eng.submit(Request(p, max_new_tokens=10, on_event=lambda e: events.setdefault(e.request_id, [])
                                  .append(e), **kw)) for p, kw in zip(prompts, requests)]
        while not all(eng.outputs.groups.get(i) is None and i in events for i in ids):
            eng.step()
        every = [e for i in ids for e in events[i]]
        firsts = {}  # each choice's first token's logprob
        for e in every:
            if e.tokens:
                firsts.setdefault((e.request_id, e.index), e.tokens[0].logprob)
        return ([(e.request_id, e.index, e.token_ids, e.finish_reason, [t.id for t in e.tokens or []]) for e in every],
                [t.logprob for e in every for t in e.tokens or []], firsts)

    (got, got_logprobs, got_firsts), (want, want_logprobs, want_firsts) = (
        serve(engine), serve(Engine(tiny, ToyTokenizer(), ROOMY)))
    assert got == want
    # The first tokens' from the prefill worker's logits, whose chunks are its own token budget's (16, co-located
    # 24): bit for bit under torch's AVX2 kernels, within float32 rounding under its AVX-512 ones (their GEMMs round
    # by row count). The later ones are decode rows in batches of other rows than co-located (rounding differs with
    # the batch's block-table width).
    assert len(got_firsts) == 3 and got_firsts.keys() == want_firsts.keys()  # requests with logprobs: 2 + 1 choices
    assert [got_firsts[k] for k in want_firsts] == pytest.approx(list(want_firsts.values()), rel=1e-6)
    if torch.backends.cpu.get_cpu_capability() == "AVX2":
        assert got_firsts == want_firsts
    assert got_logprobs == pytest.approx(want_logprobs, abs=1e-5)


def test_a_short_prompt_does_not_wait_for_a_long_one(tiny, pair):
    """The prefill worker computes one chunk of each prompt in turn: a short prompt sent after a long one (10 chunks)
    arrives first, and both answer exactly."""
    engine, _ = pair
    long, short = random_prompts([160, 12], seed=8)
    order, arrive = [], engine.scheduler.arrive
    engine.scheduler.arrive = lambda t: (order.append(len(t.seq.tokens)), arrive(t))
    got = engine.generate([long, short], max_new_tokens=6)
    assert order == [12, 160]
    assert [c.tokens for c in got] == [greedy_ids(tiny, p, 6) for p in (long, short)]


def test_a_small_prefill_pool_queues_prompts_and_refuses_one_too_long(tiny):
    """A prefill worker with 19 usable blocks of 4: three 60-token prompts (15 blocks each) wait for each other's
    blocks and answer exactly; a 100-token prompt (25 blocks) fails alone, naming the pool."""
    engine = DecodeEngine(tiny, ToyTokenizer(), ROOMY)
    worker = Worker(tiny, engine, EngineConfig(block_size=4, num_blocks=20, token_budget=16))
    try:
        prompts = random_prompts([60, 60, 100, 60], seed=4)
        events = []
        engine.submit(Request(prompts[2], max_new_tokens=5, on_event=events.append))
        got = engine.generate(prompts[:2] + prompts[3:], max_new_tokens=5)
        assert [c.tokens for c in got] == [greedy_ids(tiny, p, 5) for p in prompts[:2] + prompts[3:]]
        while not events:
            engine.step()
        assert events[-1].finish_reason == "error"
        assert "more KV blocks than the prefill worker's pool (its --num-blocks) holds" in events[-1].error
    finally:
        worker.close()
        engine.close()


def test_prompt_logprobs_are_computed_on_the_decode_worker(tiny):
    """An echo request (prompt logprobs) is prefilled where it is served: it needs no prefill worker."""
    engine = DecodeEngine(tiny, ToyTokenizer(), ROOMY)
    try:
        prompt = random_prompts([20])[0]
        with pytest.raises(Unavailable, match="no prefill worker is connected"):
            engine.submit(Request(prompt, max_new_tokens=4))
        events = []
        engine.submit(Request(prompt, max_new_tokens=0, prompt_logprobs=0, on_event=events.append))
        while not events:
            engine.step()
        assert events[0].finish_reason == "length" and len(events[0].prompt_logprobs) == 20
    finally:
        engine.close()


def test_a_prefill_worker_lost_mid_transfer_fails_only_its_requests(tiny):
    """The worker's connection breaks after the first chunk of a long prompt: that request ends with an error naming
    the lost worker; a request already decoding finishes exactly; the next one is Unavailable (503) until a worker
    connects again, and then served exactly. No block stays held."""
    engine = DecodeEngine(tiny, ToyTokenizer(), ROOMY)
    worker = Worker(tiny, engine)
    short, long = random_prompts([6, 150], seed=9)
    want_short = greedy_ids(tiny, short, 30)
    events = {}
    engine.submit(Request(short, max_new_tokens=30, on_event=lambda e: events.setdefault("short", []).append(e)))
    while "short" not in events:
        engine.step()
    step = worker.worker.step

    def dies_after_one_chunk(tokens, pos, cache, **kw):
        if pos[0] > 0 and engine.link.peers:  # the second chunk: once the first one's blocks are in, cut the line
            wait_until(lambda: engine.link.bytes_received > 0, "no block arrived")
            worker.stop.set()  # and do not redial
            engine.link.peers[0].sock.shutdown(socket.SHUT_RDWR)
        return step(tokens, pos, cache, **kw)

    worker.worker.step = dies_after_one_chunk
    engine.submit(Request(long, max_new_tokens=5, on_event=lambda e: events.setdefault("long", []).append(e)))
    while not (events.get("long") and events["long"][-1].finished and events["short"][-1].finished):
        engine.step()
    assert events["long"][-1].finish_reason == "error"
    assert "was lost mid-transfer" in events["long"][-1].error
    assert [t for e in events["short"] for t in e.token_ids] == want_short
    assert events["short"][-1].finish_reason == "length"
    wait_until(lambda: engine.link.connected() == 0, "the lost worker is still listed")
    with pytest.raises(Unavailable):
        engine.submit(Request(short, max_new_tokens=3))
    worker.thread.join(10)
    worker = Worker(tiny, engine)
    try:
        assert engine.generate([long, short], max_new_tokens=8)[0].tokens == greedy_ids(tiny, long, 8)
        wait_until(lambda: engine.stats()["blocks_used"] == 0, "blocks still held")
    finally:
        worker.close()
        engine.close()


def test_a_silent_prefill_worker_times_out(tiny):
    """A peer that says hello and then nothing (a hung process, a cut cable): after kv timeout its request fails
    and the engine serves on."""
    engine = DecodeEngine(tiny, ToyTokenizer(), ROOMY, timeout=0.5)
    try:
        sock = socket.create_connection(disagg.parse_address(engine.link.address))
        disagg.send(sock, disagg.hello(tiny, engine.pool, None))
        assert disagg.receive(sock)[0]["type"] == "welcome"
        got = engine.generate([random_prompts([30])[0]], max_new_tokens=4)[0]
        assert got.finish_reason == "error" and got.tokens == []
        assert engine.link.connected() == 0 and engine.stats()["blocks_used"] == 0
        sock.close()
    finally:
        engine.close()


def test_a_worker_with_other_weights_or_key_is_refused(tiny):
    import copy

    other = copy.deepcopy(tiny)
    with torch.no_grad():
        other.embed_tokens.weight[0, 0] += 1
    engine = DecodeEngine(tiny, ToyTokenizer(), ROOMY, key="s3cret")
    try:
        for model, key, why in [(other, "s3cret", "other weights"), (tiny, "wrong", "wrong or missing --api-key"),
                                (tiny, None, "wrong or missing --api-key")]:
            with pytest.raises(ValueError, match=why):
                PrefillWorker(model, PREFILL, key=key).serve(
                    socket.create_connection(disagg.parse_address(engine.link.address)), threading.Event())
        with pytest.raises(ValueError, match="KV block layout"):
            PrefillWorker(tiny, EngineConfig(block_size=8), key="s3cret").serve(
                socket.create_connection(disagg.parse_address(engine.link.address)), threading.Event())
        assert engine.link.connected() == 0
    finally:
        engine.close()


def test_an_aborted_request_cancels_its_transfer(tiny, pair):
    engine, worker = pair
    prompts = random_prompts([150, 20], seed=2)
    ids = [engine.submit(Request(p, max_new_tokens=6)) for p in prompts]
    engine.step()  # both sent to the worker
    engine.abort(ids[0])
    while engine.has_work():
        engine.step()
    wait_until(lambda: engine.stats()["blocks_used"] == 0 and worker.worker.blocks.in_use() == 0, "blocks held")
    assert engine.generate(prompts, max_new_tokens=6)[0].tokens == greedy_ids(tiny, prompts[0], 6)


def test_completions_over_http_as_colocated_and_503_without_a_worker(tiny_text_dir):
    """The decode worker owns the HTTP front: without a prefill worker a completion is a 503 with Retry-After;
    with one, 6 concurrent completions (half streamed) answer as the co-located server does."""
    import asyncio

    from load import load_model
    from serving.app import make_app
    from tokenizer import load_tokenizer

    model, _ = load_model(tiny_text_dir, "cpu", torch.float32)
    tok = load_tokenizer(tiny_text_dir)
    words = "the quick brown fox jumps over a lazy dog while it rains".split()
    bodies = [{"prompt": " ".join(words[:n]) * (1 + n % 3), "max_tokens": 12, "temperature": 0, "stream": n % 2 == 0}
              for n in range(2, 8)]

    async def answer(h, body):
        r = await h.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        if not body["stream"]:
            return r.json()["choices"][0]["text"]
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        return "".join(c["choices"][0]["text"] for c in chunks)

    async def serve(engine, worker: bool):
        app = make_app(engine, tok, "m")
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8000",
                                         timeout=60) as h:
                if not worker:
                    return await asyncio.gather(*(answer(h, b) for b in bodies))
                r = await h.post("/v1/completions", json=bodies[0])
                assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
                assert "no prefill worker is connected" in r.json()["error"]["message"]
                started = await asyncio.to_thread(Worker, model, engine)
                try:
                    got = await asyncio.gather(*(answer(h, b) for b in bodies))
                    assert (await h.get("/health")).json()["engine"]["prefill_workers"] == 1
                finally:
                    await asyncio.to_thread(started.close)
                return got

    want = asyncio.run(serve(Engine(model, tok, ROOMY), False))
    engine = DecodeEngine(model, tok, ROOMY)
    try:
        assert asyncio.run(serve(engine, True)) == want
    finally:
        engine.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_blocks_round_trip(dtype):
    a = BlockPool(3, 10, 4, 2, 8, dtype, "cpu")
    b = BlockPool(3, 10, 4, 2, 8, dtype, "cpu")
    for t in (*a.k, *a.v):
        t.copy_(torch.randn(t.shape))
    data = disagg.pack(a, [2, 5, 7])
    assert data.dtype == torch.uint8 and data.numel() == 3 * disagg.block_bytes(a)
    disagg.unpack(b, [1, 3, 9], data)
    for x, y in zip((*a.k, *a.v), (*b.k, *b.v)):
        assert torch.equal(x[[2, 5, 7]], y[[1, 3, 9]]) and not y[[0, 2, 4, 5, 6, 7, 8]].any()


def test_role_flags_are_checked_before_the_model_loads(cli_error):
    import serve

    assert "--kv-address must be HOST:PORT, got '8001'" in cli_error(serve.main, ["--role", "decode", "--kv-address",
                                                                                   "8001"])
    assert "--role prefill needs the whole-context KV cache" in cli_error(serve.main, ["--role", "prefill",
                                                                                       "--cache-window", "64"])
    assert "--kv-timeout must be > 0" in cli_error(serve.main, ["--role", "decode", "--kv-timeout", "0"])
    args = serve.parse_args(["--role", "decode", "--kv-address", "127.0.0.1:0"])
    assert (args.role, args.kv_address, args.kv_timeout) == ("decode", "127.0.0.1:0", 30.0)


# ---- two processes: serve.py --role decode and --role prefill (SmolLM2) ----

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_role(gguf: str, role: str, kv: int, *flags: str) -> subprocess.Popen:
    """`python serve.py --role ROLE` on SmolLM2 in float32, batch-invariant (--deterministic), one thread, its output
    to a pipe."""
    return subprocess.Popen([sys.executable, "serve.py", "--role", role, "--model", gguf, "--dtype", "float32",
                             "--deterministic", "--threads", "1", "--quiet", "--kv-address", f"127.0.0.1:{kv}", *flags],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def health(url: str) -> dict:
    try:
        return httpx.get(f"{url}/health", timeout=5).json()
    except httpx.TransportError:
        return {}


def wait_for_workers(url: str, procs: list, n: int = 1) -> None:
    deadline = time.monotonic() + 180
    while health(url).get("engine", {}).get("prefill_workers") != n:
        for p in procs:
            assert p.poll() is None, f"serve.py exited with {p.returncode}: {p.stdout.read()}"
        assert time.monotonic() < deadline, "the pair did not come up within 180 s"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def colocated(smollm2_gguf, smollm2_tokenizer):
    """The co-located engine over SmolLM2 as serve.py loads it (float32, the file's codes), its default pool, batch
    invariant: SmolLM2's Q8_0 head computes in bf16 and has near-ties that a decode row's rounding, which depends on
    its batch-mates (who arrived when), can flip; --deterministic makes every row's answer its own."""
    from load import load_model

    model, _ = load_model(smollm2_gguf, "cpu", torch.float32)
    step = Step(model, deterministic=True)
    return Engine(model, smollm2_tokenizer, EngineConfig(num_blocks=513), step), smollm2_tokenizer


@pytest.fixture(scope="module")
def text() -> str:
    with open(os.path.join(ROOT, "data", "pride_and_prejudice_ch1-2.txt"), encoding="utf-8") as f:
        return f.read()


def post(url: str, route: str, body: dict) -> tuple[int, str]:
    """(status, the answer's text: a choice's text or message content, streamed or not; else the error message)."""
    r = httpx.post(f"{url}{route}", json=body, timeout=300)
    if r.status_code != 200:
        return r.status_code, r.json()["error"]["message"]
    if not body.get("stream"):
        choice = r.json()["choices"][0]
        return 200, choice["text"] if "text" in choice else choice["message"]["content"]
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    if any("error" in c for c in chunks):
        return 500, next(c["error"]["message"] for c in chunks if "error" in c)
    parts = [c["choices"][0].get("text", c["choices"][0].get("delta", {}).get("content")) for c in chunks
             if c.get("choices")]
    return 200, "".join(p or "" for p in parts)


@pytest.fixture(scope="module")
def processes(smollm2_gguf):
    """`serve.py --role decode` and a `--role prefill` worker (chunks of 128 tokens) over SmolLM2, shared by this
    module's two-process tests: (url, kv port, {role: process}); a test that replaces the prefill worker puts its
    new one in the dict, which is stopped at the end."""
    port, kv = free_port(), free_port()
    procs = {"decode": start_role(smollm2_gguf, "decode", kv, "--port", str(port))}
    procs["prefill"] = start_role(smollm2_gguf, "prefill", kv, "--token-budget", "128")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_workers(url, list(procs.values()))
        yield url, kv, procs
    finally:
        stop_server(procs["prefill"])
        stop_server(procs["decode"])


@pytest.mark.slow
def test_two_processes_answer_16_concurrent_requests_as_colocated(colocated, processes, text):
    """8 completions (token ids, 10 to ~400 tokens) and 8 chats, half of each streamed, all at once through the
    decode worker's HTTP front: the co-located engine's greedy texts."""
    from concurrent.futures import ThreadPoolExecutor

    engine, tok = colocated
    url, _, _ = processes
    prompts = [tok.encode(text[i * 700:i * 700 + n]) for i, n in enumerate([40, 1600, 300, 900, 120, 60, 1200, 500])]
    chats = [[{"role": "user", "content": q}] for q in ["What is the capital of France?", "Name three colours.",
             "Write a haiku about rain.", text[:600] + "\nWho speaks first here?", "What is 2 + 2?",
             "Say hello in Spanish.", text[3000:3400] + "\nSummarize this.", "List two fruits."]]
    chat_ids = [tok.encode(tok.apply_chat_template(c), bos=False) for c in chats]
    want = [c.text for c in engine.generate(prompts + chat_ids, max_new_tokens=16)]
    bodies = [("/v1/completions", {"prompt": p, "max_tokens": 16, "temperature": 0, "stream": i % 2 == 0})
              for i, p in enumerate(prompts)]
    bodies += [("/v1/chat/completions", {"messages": c, "max_tokens": 16, "temperature": 0, "stream": i % 2 == 1})
               for i, c in enumerate(chats)]
    received = health(url)["engine"]["kv_bytes_received"]
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda b: post(url, *b), bodies))
    assert got == [(200, w) for w in want]
    received = health(url)["engine"]["kv_bytes_received"] - received
    assert received > sum(map(len, prompts)) * 46080 * 0.9  # 45 KiB a token


@pytest.mark.slow
def test_killing_the_prefill_worker_mid_transfer_fails_only_its_request(smollm2_gguf, colocated, processes, text):
    """SIGKILL the prefill worker while a long prompt's blocks arrive: that request gets a 500 naming the lost
    worker, a stream already decoding finishes with the co-located text, the decode worker stays healthy and
    answers 503 until a prefill worker connects again, which then serves exactly."""
    from concurrent.futures import ThreadPoolExecutor

    engine, tok = colocated
    url, kv, procs = processes
    short, long = tok.encode("1, 2, 3,"), tok.encode(text[2000:5000])  # ~760 tokens: 6 chunks of 128
    want_short, want_long = (c.text for c in engine.generate([short, long], max_new_tokens=40))
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(post, url, "/v1/completions", {"prompt": short, "max_tokens": 40, "temperature": 0,
                                                           "stream": True})
        while health(url)["engine"]["running"] == 0:
            time.sleep(0.05)
        received = health(url)["engine"]["kv_bytes_received"]  # the short prompt's blocks are in
        second = pool.submit(post, url, "/v1/completions", {"prompt": long, "max_tokens": 40, "temperature": 0})
        while health(url)["engine"]["kv_bytes_received"] < received + 46080 * 64:  # its first chunk in
            time.sleep(0.02)
        procs["prefill"].kill()
        assert first.result() == (200, want_short)
        status, message = second.result()
    assert status == 500 and "was lost mid-transfer" in message, message
    assert health(url)["status"] == "ok" and health(url)["engine"]["prefill_workers"] == 0
    assert post(url, "/v1/completions", {"prompt": short, "max_tokens": 4})[0] == 503
    procs["prefill"] = start_role(smollm2_gguf, "prefill", kv)
    wait_for_workers(url, list(procs.values()))
    assert post(url, "/v1/completions", {"prompt": long, "max_tokens": 40, "temperature": 0}) == (200, want_long)
    assert health(url)["engine"]["blocks_used"] == 0
