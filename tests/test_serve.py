"""serve.py as a client sees it: the official openai client against a real server process with the default
offline model. Greedy answers equal generate.generate's, streams concatenate to the whole answer, bad requests get
OpenAI-style 400s, and a client that goes away mid-generation has its request aborted and its KV blocks freed."""
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import openai
import pytest
import torch

import loadtest
from engine import Engine, EngineConfig, Request
from generate import generate
from load import load_model
from serve import make_app
from tokenizer import load_tokenizer

try:
    import httpx2 as httpx  # the maintained HTTPX, which the openai client depends on
except ImportError:
    import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "The capital of France is"
LONG = "1, 2, 3, 4, 5, 6, 7, 8,"  # greedy counts on for hundreds of tokens: no EOS ends it early
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    """The base URL of `python serve.py` on a free loopback port, for the whole module."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "serve.py", "--model", smollm2_gguf, "--port", str(port), "--quiet"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, f"serve.py exited with {proc.returncode}: {proc.stdout.read()}"
        assert time.monotonic() < deadline, "serve.py did not answer /health within 120 s"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    """(model, tokenizer) in this process, float32 on CPU as the server loads them."""
    model, path = load_model(smollm2_gguf, "cpu", torch.float32)
    return model, load_tokenizer(path)


def greedy_text(reference, prompt: list[int], n: int) -> tuple[str, int]:
    """generate.generate's greedy text for `prompt` (up to an EOS, not included) and the tokens it sampled."""
    model, tokenizer = reference
    tokens = list(generate(model, prompt, n, temperature=0.0, stop_ids=tokenizer.eos_ids))
    return tokenizer.decode([t for t in tokens if t not in tokenizer.eos_ids]), len(tokens)


def engine_idle(server: str) -> dict:
    """The engine's stats once no sequence runs or waits and no KV block is held (cached ones may stay)."""
    deadline = time.monotonic() + 20
    while True:
        stats = httpx.get(f"{server}/health").json()["engine"]
        if stats["running"] == stats["waiting"] == stats["blocks_used"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def aborted(server: str) -> int:
    for line in httpx.get(f"{server}/metrics").text.splitlines():
        if line.startswith('llm_requests_finished_total{finish_reason="abort"}'):
            return int(line.split()[-1])
    return 0


def test_completion_is_greedy_generate(client, reference):
    r = client.completions.create(model="any", prompt=PROMPT, max_tokens=8, temperature=0)
    prompt = reference[1].encode(PROMPT)
    want, n = greedy_text(reference, prompt, 8)
    assert n == 8, "the reference hit an EOS: pick a prompt that runs to max_tokens"
    assert r.choices[0].text == want and want
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(prompt), 8, len(prompt) + 8)
    assert r.object == "text_completion" and r.model == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_streamed_completion_concatenates_to_the_whole(client):
    whole = client.completions.create(model="any", prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model="any", prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_stop_string_and_seeded_sampling(client):
    whole = client.completions.create(model="any", prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    stop = whole[3:6]
    cut = client.completions.create(model="any", prompt=PROMPT, max_tokens=8, temperature=0, stop=stop)
    assert cut.choices[0].text == whole[:whole.find(stop)] and cut.choices[0].finish_reason == "stop"
    a, b = (client.completions.create(model="any", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7).choices[0]
            .text for _ in range(2))
    assert a == b


def test_chat_is_greedy_generate(client, reference):
    r = client.chat.completions.create(model="any", messages=CHAT, max_tokens=16, temperature=0)
    tokenizer = reference[1]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(CHAT), bos=False)
    want, n = greedy_text(reference, prompt, 16)
    assert r.choices[0].message.content == want and "Paris" in want
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ("length" if n == 16 else "stop")
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == n


def test_streamed_chat_concatenates_to_the_whole(client):
    whole = client.chat.completions.create(model="any", messages=CHAT, max_tokens=16, temperature=0).choices[0]
    chunks = list(client.chat.completions.create(model="any", messages=CHAT, max_tokens=16, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.message.content
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_models_health_and_metrics(client, server):
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
    health = httpx.get(f"{server}/health").json()
    assert health["status"] == "ok" and health["engine"]["blocks_total"] > 0
    text = httpx.get(f"{server}/metrics").text
    for name in ("llm_http_requests_total{", "llm_requests_running ", "llm_requests_waiting ",
                 "llm_kv_blocks_used ", "llm_kv_blocks_total ", "llm_kv_blocks_cached ",
                 'llm_time_to_first_token_seconds_bucket{le="+Inf"} ', "llm_time_to_first_token_seconds_sum ",
                 "llm_time_to_first_token_seconds_count ", "llm_time_per_output_token_seconds_count ",
                 "# TYPE llm_time_per_output_token_seconds histogram"):
        assert name in text, name


def test_malformed_json_is_400(server):
    r = httpx.post(f"{server}/v1/completions", content=b'{"prompt": "hi", ',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "not valid JSON" in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    r = httpx.get(f"{server}/v1/nothing")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "n": 2}, "n"),
    ({"prompt": "hi", "max_tokens": "3"}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": "hi", "frobnicate": 1}, "frobnicate"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [1, 10 ** 9]}, "prompt"),
])
def test_invalid_parameters_are_400(server, body, param):
    r = httpx.post(f"{server}/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


def test_invalid_parameters_with_the_openai_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="any", messages=CHAT, temperature=-0.5)
    assert e.value.status_code == 400 and "temperature" in e.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="any", messages=[{"role": "wizard", "content": "hi"}])


def test_prompt_longer_than_the_context_is_400(server):
    r = httpx.post(f"{server}/v1/completions", json={"prompt": [1] * 9000, "max_tokens": 1})
    assert r.status_code == 400 and "longer than" in r.json()["error"]["message"]


def test_client_leaving_a_stream_aborts_its_request(server):
    before = aborted(server)
    body = {"prompt": LONG, "max_tokens": 1000, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body) as r:
        assert r.status_code == 200
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
    stats = engine_idle(server)  # 1000 tokens take far longer than its 20 s wait: only an abort ends it
    assert (stats["running"], stats["waiting"], stats["blocks_used"]) == (0, 0, 0), stats
    assert aborted(server) == before + 1


def test_client_leaving_a_plain_request_aborts_it(server):
    before = aborted(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", json={"prompt": LONG, "max_tokens": 1000, "temperature": 0},
                   timeout=1.0)
    stats = engine_idle(server)
    assert (stats["running"], stats["waiting"], stats["blocks_used"]) == (0, 0, 0), stats
    assert aborted(server) == before + 1


def test_full_queue_is_429(reference):
    """In process, with no engine thread: a queued request stays queued, so the next one finds the queue full."""
    model, tokenizer = reference
    engine = Engine(model, tokenizer, EngineConfig(num_blocks=8, max_waiting=1))
    engine.submit(Request(tokenizer.encode(PROMPT)))

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=make_app(engine, tokenizer, "m"))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await c.post("/v1/completions", json={"prompt": PROMPT})

    r = asyncio.run(post())
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"


def test_loadtest_against_the_server(server, tmp_path, capsys):
    out = tmp_path / "load.json"
    assert loadtest.main(["--url", server, "--rates", "20", "--concurrency", "2", "--requests", "3",
                          "--max-tokens", "4", "--max-words", "20", "--warmup", "0", "--json", str(out)]) == 0
    points = json.loads(out.read_text())["points"]
    assert [(p["mode"], p["ok"], p["failed"]) for p in points] == [("rate", 3, 0), ("concurrency", 3, 0)]
    for p in points:
        assert all(s["completion_tokens"] == 4 and s["ttft_s"] > 0 and s["tpot_s"] > 0 for s in p["samples"])
        assert p["ttft_p50_s"] <= p["ttft_p95_s"] <= p["ttft_p99_s"]
    assert "| 20 req/s Poisson | 3 | 0 |" in capsys.readouterr().out


def test_loadtest_refuses_other_hosts(capsys):
    assert loadtest.main(["--url", "http://10.0.0.1:8000", "--rates", "1"]) == 1
    assert "not this machine" in capsys.readouterr().err


def test_bad_flag_is_one_line():
    r = subprocess.run([sys.executable, "serve.py", "--num-blocks", "0"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and r.stderr.strip() == "error: --num-blocks must be >= 1, got 0", r.stderr


def test_port_in_use_is_one_line(server):
    port = server.rsplit(":", 1)[1]
    r = subprocess.run([sys.executable, "serve.py", "--port", port], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and r.stderr.strip() == f"error: cannot listen on 127.0.0.1:{port}: Address already in use"
