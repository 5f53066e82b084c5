"""Embeddings: features/embed.py's pooled vectors against transformers' final hidden states on the same random
weights, the engine running them as jobs between its steps (a generation in flight unchanged), and
serving/embeddings.py's request parsing and answer shapes (base64 as OpenAI's little-endian float32)."""
import base64
import struct

import pytest
import torch
import torch.nn.functional as F

from features.embed import embed, hidden_states
from helpers import toy_bpe
from serving.embeddings import EmbeddingCall, embeddings_body, parse_embeddings
from serving.engine import Engine, EngineConfig
from serving.protocol import BadRequest
from tiny_models import hf_to_ours, make_hf

SEQS = [[5, 9, 33, 2, 71, 8], [40, 41], [7]]


@pytest.fixture(scope="module")
def pair():
    hf = make_hf("qwen2")  # biases and norms drawn at random: a lost final norm or bias would show
    return hf, hf_to_ours(hf)


def test_pooling_equals_transformers_hidden_states(pair):
    """Mean and last-token pooling of the final (normed) hidden states equal the same pooling of transformers'
    last_hidden_state, normalized; identical inputs give identical vectors, all finite and of unit norm."""
    hf, ours = pair
    for ids in SEQS:
        want = hf.model(torch.tensor([ids])).last_hidden_state[0]  # (T, C), after the final norm
        torch.testing.assert_close(hidden_states(ours, ids), want, atol=1e-5, rtol=1e-5)
        for pooling, vector in (("mean", want.mean(0)), ("last", want[-1])):
            got = torch.tensor(embed(ours, [ids], pooling)[0])
            torch.testing.assert_close(got, F.normalize(vector, dim=0), atol=1e-5, rtol=1e-5)
    vectors = torch.tensor(embed(ours, [SEQS[0], SEQS[1], SEQS[0]]))
    assert torch.equal(vectors[0], vectors[2]) and not torch.allclose(vectors[0], vectors[1])
    assert vectors.isfinite().all() and torch.allclose(vectors.norm(dim=1), torch.ones(3))
    with pytest.raises(ValueError, match="pooling"):
        embed(ours, [SEQS[0]], "cls")


def test_the_engine_runs_jobs_between_steps(pair):
    """A job submitted while a generation runs is run by step(), on the stepping thread, and the generation's
    tokens are those of a run without it."""
    _, ours = pair
    engine = Engine(ours, toy_bpe(), EngineConfig(num_blocks=32, max_running=4))
    want = engine.generate([SEQS[0]], max_new_tokens=8)[0].tokens
    jobs = [engine.run_job(lambda ids=ids: embed(ours, [ids])) for ids in SEQS]
    got = engine.generate([SEQS[0]], max_new_tokens=8)[0].tokens
    assert got == want and all(job.done() for job in jobs)
    assert [job.result()[0] for job in jobs] == embed(ours, SEQS)
    failing = engine.run_job(lambda: embed(ours, [[]]))
    engine.step()
    assert isinstance(failing.exception(), ValueError)  # the job's error is its caller's; the engine serves on
    waiting = engine.run_job(lambda: 1)
    engine.fail_jobs("stopping")
    with pytest.raises(RuntimeError, match="stopping"):
        waiting.result()


def test_parse_embeddings_and_the_answer(smollm2_tokenizer):
    tok = smollm2_tokenizer
    limits = {"max_len": 64, "max_chars": 10 ** 6, "dim": 3}
    assert parse_embeddings({"input": "hello world"}, tok, **limits).inputs == [tok.encode("hello world")]
    call = parse_embeddings({"input": ["a", "b c"], "model": "x", "encoding_format": "base64"}, tok, **limits)
    assert call.inputs == [tok.encode("a"), tok.encode("b c")] and call.base64 and call.model == "x"
    assert parse_embeddings({"input": [1, 2, 3]}, tok, **limits).inputs == [[1, 2, 3]]
    assert parse_embeddings({"input": [[1, 2], [3]], "dimensions": 3}, tok, **limits).inputs == [[1, 2], [3]]
    for body, param in [({"input": ""}, "input"), ({"input": []}, "input"), ({"input": [[1], "a", 5]}, "input"),
                        ({"input": [tok.vocab_size]}, "input"), ({"input": "a " * 100}, "input"),
                        ({"input": "a", "dimensions": 2}, "dimensions"),
                        ({"input": "a", "encoding_format": "int8"}, "encoding_format")]:
        with pytest.raises(BadRequest) as e:
            parse_embeddings(body, tok, **limits)
        assert e.value.param == param, body
    vectors = [[0.5, -0.25, 1.0], [0.0, 1.0, 0.0]]
    floats = embeddings_body(EmbeddingCall([[1, 2], [3]]), vectors, "m")
    assert floats == {"object": "list", "model": "m", "usage": {"prompt_tokens": 3, "total_tokens": 3},
                      "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]}
    packed = embeddings_body(EmbeddingCall([[1, 2], [3]], base64=True, model="x"), vectors, "m")
    assert packed["model"] == "x"
    assert [list(struct.unpack("<3f", base64.b64decode(d["embedding"]))) for d in packed["data"]] == vectors


def test_the_route_pools_as_serve_py_says(pair):
    """serve.py --pooling reaches the app: /v1/embeddings over a tiny model answers embed(..., "last")'s vectors,
    and a request while the engine thread serves a generation is answered too."""
    import asyncio

    import httpx

    from serve import parse_args, serve_config
    from serving.app import make_app

    _, ours = pair
    config = serve_config(parse_args(["--pooling", "last"]))
    assert (config.pooling, serve_config(parse_args([])).pooling) == ("last", "mean")
    tok = toy_bpe()
    app = make_app(Engine(ours, tok, EngineConfig(num_blocks=32, max_running=4)), tok, "m", config=config)

    async def main():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8000",
                                         timeout=60) as c:
                generation = c.post("/v1/completions", json={"prompt": SEQS[0], "max_tokens": 8, "ignore_eos": True})
                embedding = c.post("/v1/embeddings", json={"input": SEQS, "model": "x"})
                return await asyncio.gather(generation, embedding)

    generated, embedded = asyncio.run(main())
    assert generated.status_code == 200 and generated.json()["usage"]["completion_tokens"] == 8
    body = embedded.json()
    assert [d["embedding"] for d in body["data"]] == embed(ours, SEQS, "last") and body["model"] == "x"
    assert body["usage"] == {"prompt_tokens": 9, "total_tokens": 9}
