"""The OpenAI surface that clients call, through the official `openai` client against the app in this process
(over the reference model, float32 SmolLM2): logprobs on both endpoints, echo with the prompt's logprobs, batched
prompts, n and best_of, logit_bias, min_tokens / ignore_eos, continuous usage, unknown fields, models.retrieve,
/tokenize and /detokenize. Each answer is checked against the in-process model."""
import asyncio
import base64
import importlib
import math
import os
import struct

import openai
import pytest
import torch

from decode import generate
from serving.engine import Engine, EngineConfig
from serving.gate import ServeConfig
from params import SamplingParams
from serving.app import make_app

# The HTTPX the openai client is built on (httpx2 from openai 3, httpx before): an http_client passed to it must
# be one of its clients, and whichever pip resolved is the one installed.
httpx = importlib.import_module(openai.DefaultAsyncHttpxClient.__mro__[1].__module__.split(".")[0])

pytestmark = pytest.mark.slow  # every test here serves SmolLM2 (the fast subset has none)

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
LOCAL = "http://127.0.0.1:8000"


@pytest.fixture(scope="module")
def reference(smollm2):
    return smollm2


def call(reference, fn, **config):
    """Run `await fn(client, http)` against a fresh app over the reference model (its engine on a thread)."""
    model, tokenizer = reference
    engine = Engine(model, tokenizer, EngineConfig(num_blocks=128, max_running=8, token_budget=64))
    app = make_app(engine, tokenizer, "m", config=ServeConfig(**config))

    async def main():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=LOCAL, timeout=120) as h:
                client = openai.AsyncOpenAI(base_url=f"{LOCAL}/v1", api_key="x", http_client=h, max_retries=0)
                return await fn(client, h)

    return asyncio.run(main())


def greedy_tokens(reference, prompt: list[int], n: int, logprobs: int):
    model, tokenizer = reference
    return list(generate(model, prompt, max_new_tokens=n, params=SamplingParams(), stop_ids=tokenizer.eos_ids,
                         logprobs=logprobs))


def teacher_forced(model, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1, from one uncached forward."""
    logits = model(torch.tensor([ids]), torch.arange(len(ids)), all_logits=True)[0].float()  # (T, V)
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def test_chat_and_completion_logprobs_are_the_models(reference):
    """Greedy: each token's logprob and its top alternatives equal decode.generate(logprobs=N)'s; streaming
    gives the same entries in pieces."""
    model, tok = reference

    async def fn(c, h):
        chat = await c.chat.completions.create(model="m", messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                               top_logprobs=3)
        chunks = [x async for x in await c.chat.completions.create(
            model="m", messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, stream=True)]
        comp = await c.completions.create(model="m", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
        return chat, chunks, comp

    chat, chunks, comp = call(reference, fn)
    want = greedy_tokens(reference, tok.encode_chat(CHAT), 6, 3)
    content = chat.choices[0].logprobs.content
    assert [e.token for e in content] == [tok.token_text(t.id) for t in want]
    for e, t in zip(content, want):
        assert math.isclose(e.logprob, t.logprob, abs_tol=1e-5)
        assert [a.token for a in e.top_logprobs] == [tok.token_text(i) for i, _ in t.top] and len(t.top) == 3
        assert bytes(e.bytes) == tok.token_bytes(t.id)
    streamed = [e for x in chunks if x.choices and x.choices[0].logprobs for e in x.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]  # the prompt now comes from the prefix cache:
    assert all(math.isclose(a.logprob, b.logprob, abs_tol=1e-5) for a, b in zip(streamed, content))  # ~1e-6 off
    want = greedy_tokens(reference, tok.encode(PROMPT), 6, 2)
    lp = comp.choices[0].logprobs
    assert lp.tokens == [tok.token_text(t.id) for t in want]
    assert all(math.isclose(a, t.logprob, abs_tol=1e-5) for a, t in zip(lp.token_logprobs, want))
    assert all(len(top) >= 2 for top in lp.top_logprobs)
    assert lp.text_offset[0] == len(PROMPT)


def test_echo_gives_the_prompts_teacher_forced_logprobs_even_from_the_prefix_cache(reference):
    """lm-eval's loglikelihood request: echo, logprobs=1, max_tokens 0 or 1. The prompt's logprobs equal one
    uncached forward's; sent twice (the second finds its blocks in the prefix cache) they are still there."""
    model, tok = reference
    text = "The capital of France is Paris, and the capital of Italy is Rome. " * 3
    ids = tok.encode(text)

    async def fn(c, h):
        return [await c.completions.create(model="m", prompt=ids, max_tokens=m, temperature=0, echo=True,
                                           logprobs=1) for m in (0, 1, 0)]

    answers = call(reference, fn)
    want = teacher_forced(model, ids)
    for r, m in zip(answers, (0, 1, 0)):
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == len(ids) + m and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:len(ids)], want)) < 1e-4
        assert r.choices[0].text.startswith(tok.decode(ids)) and r.usage.completion_tokens == m
    assert answers[1].usage.prompt_tokens == len(ids)


def test_a_batch_of_prompts_answers_each_as_alone(reference):
    prompts = [PROMPT, "Once upon a time", [1, 2, 3, 4]]

    async def fn(c, h):
        batch = await c.completions.create(model="m", prompt=prompts, max_tokens=8, temperature=0.9, seed=3)
        alone = [await c.completions.create(model="m", prompt=p, max_tokens=8, temperature=0.9, seed=3)
                 for p in prompts]
        return batch, alone

    batch, alone = call(reference, fn)
    assert [ch.index for ch in batch.choices] == [0, 1, 2]
    assert [ch.text for ch in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)


def test_n_choices_share_a_prompt_and_best_of_keeps_the_likeliest(reference):
    """n=3 with a seed: choice 0 is the n=1 answer with that seed, the others differ; best_of=3 returns the choice
    of n=3 (the same seeds) with the highest cumulative logprob; streaming indexes the choices."""
    async def fn(c, h):
        kw = dict(model="m", prompt=PROMPT, max_tokens=10, temperature=1.0, seed=11)
        three = await c.completions.create(n=3, logprobs=0, **kw)
        one = await c.completions.create(n=1, **kw)
        best = await c.completions.create(n=1, best_of=3, logprobs=0, **kw)
        chat = await c.chat.completions.create(model="m", messages=CHAT, max_tokens=5, temperature=1.0, seed=5, n=2)
        stream = [x async for x in await c.chat.completions.create(model="m", messages=CHAT, max_tokens=5,
                                                                   temperature=1.0, seed=5, n=2, stream=True)]
        return three, one, best, chat, stream

    three, one, best, chat, stream = call(reference, fn)
    assert [ch.index for ch in three.choices] == [0, 1, 2]
    assert three.choices[0].text == one.choices[0].text
    assert len({ch.text for ch in three.choices}) > 1
    score = [sum(ch.logprobs.token_logprobs) for ch in three.choices]
    assert best.choices[0].text == three.choices[score.index(max(score))].text
    assert three.usage.completion_tokens == sum(len(ch.logprobs.tokens) for ch in three.choices)
    texts = {i: "".join(x.choices[0].delta.content or "" for x in stream if x.choices and x.choices[0].index == i)
             for i in (0, 1)}
    assert texts == {i: chat.choices[i].message.content for i in (0, 1)}


def test_logit_bias_bans_and_forces_tokens(reference):
    model, tok = reference
    first = greedy_tokens(reference, tok.encode(PROMPT), 1, 0)[0].id
    forced = tok.encode(" banana", bos=False)[0]

    async def fn(c, h):
        banned = await c.completions.create(model="m", prompt=PROMPT, max_tokens=1, temperature=0,
                                            logit_bias={str(first): -100})
        pushed = await c.completions.create(model="m", prompt=PROMPT, max_tokens=3, temperature=0.7, seed=1,
                                            logit_bias={str(forced): 100})
        return banned, pushed

    banned, pushed = call(reference, fn)
    assert banned.choices[0].text != tok.decode([first])
    assert pushed.choices[0].text == tok.decode([forced] * 3)


def test_min_tokens_and_ignore_eos(reference):
    """Chat greedy ends with the end of turn within a few tokens; min_tokens holds it off, ignore_eos runs on."""
    async def fn(c, h):
        kw = dict(model="m", messages=[{"role": "user", "content": "Say yes."}], temperature=0)
        plain = await c.chat.completions.create(max_tokens=100, **kw)
        held = await c.chat.completions.create(max_tokens=100, extra_body={"min_tokens": plain.usage.completion_tokens
                                                                           + 5}, **kw)
        on = await c.chat.completions.create(max_tokens=plain.usage.completion_tokens + 8,
                                             extra_body={"ignore_eos": True}, **kw)
        return plain, held, on

    plain, held, on = call(reference, fn)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens < 90
    assert held.usage.completion_tokens >= plain.usage.completion_tokens + 5
    assert (on.choices[0].finish_reason, on.usage.completion_tokens) == ("length", plain.usage.completion_tokens + 8)


def test_continuous_usage_unknown_fields_models_and_tokenizer_routes(reference):
    model, tok = reference

    async def fn(c, h):
        chunks = [x async for x in await c.completions.create(
            model="m", prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True})]
        odd = await c.chat.completions.create(model="m", messages=CHAT, max_tokens=2, temperature=0,
                                              extra_body={"store": False, "metadata": {"a": "b"},
                                                          "parallel_tool_calls": False, "reasoning_effort": "low"})
        listed = [m.id for m in (await c.models.list()).data]
        alias = await c.models.retrieve("alias")
        with pytest.raises(openai.NotFoundError):
            await c.models.retrieve("nope")
        ids = (await h.post("/tokenize", json={"prompt": PROMPT})).json()
        text = (await h.post("/detokenize", json={"tokens": ids["tokens"]})).json()
        info = (await h.get("/tokenizer_info")).json()
        return chunks, odd, listed, alias, ids, text, info

    chunks, odd, listed, alias, ids, text, info = call(reference, fn, aliases=("alias",))
    used = [x.usage.completion_tokens for x in chunks if x.usage is not None]
    assert len(used) == len(chunks) and used == sorted(used) and used[-1] == 5
    assert odd.choices[0].message.content
    assert listed == ["m", "alias"] and alias.id == "alias"
    assert ids["tokens"] == tok.encode(PROMPT) and ids["count"] == len(ids["tokens"])
    assert text == {"prompt": PROMPT}
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template


def test_embeddings_with_the_openai_client(reference):
    """client.embeddings.create, float and base64 (what the SDK asks for by default, and decodes; asked for by the
    caller, left encoded): one unit-norm vector per input, equal to the mean of the model's final hidden states
    computed here, identical inputs identical, usage counted."""
    from features.embed import hidden_states

    model, tok = reference
    texts = ["The capital of France is Paris.", "def add(a, b): return a + b", "The capital of France is Paris."]

    async def fn(c, h):
        floats = await c.embeddings.create(model="asked", input=texts, encoding_format="float")
        default = await c.embeddings.create(model="m", input=texts[:2])
        packed = await c.embeddings.create(model="m", input=texts[:2], encoding_format="base64")
        ids = await c.embeddings.create(model="m", input=[tok.encode(texts[1])])
        with pytest.raises(openai.BadRequestError) as e:
            await c.embeddings.create(model="m", input="x", dimensions=7)
        return floats, default, packed, ids, e.value

    floats, default, packed, ids, refused = call(reference, fn)
    got = torch.tensor([d.embedding for d in floats.data])  # (3, C)
    want = torch.nn.functional.normalize(torch.stack([hidden_states(model, tok.encode(t)).mean(0) for t in texts]))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got.shape == (3, model.args.dim) and torch.equal(got[0], got[2]) and got.isfinite().all()
    assert floats.model == "asked" and [d.index for d in floats.data] == [0, 1, 2]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(len(tok.encode(t)) for t in texts)
    assert [d.embedding for d in default.data] == [d.embedding for d in floats.data[:2]]
    decoded = [struct.unpack(f"<{model.args.dim}f", base64.b64decode(d.embedding)) for d in packed.data]
    assert decoded == [tuple(d.embedding) for d in floats.data[:2]]
    assert ids.data[0].embedding == floats.data[1].embedding
    assert refused.status_code == 400 and "dimensions" in refused.message


def test_fim_on_smollm2_is_a_clear_400_and_echo_alone(reference):
    """SmolLM2-135M's vocabulary has no FIM tokens (<file_sep> and <repo_name> only): suffix and /infill are
    refused naming them. echo with max_tokens 0 and no logprobs answers the prompt; /tokenize takes llama.cpp's
    content shape."""
    model, tok = reference

    async def fn(c, h):
        with pytest.raises(openai.BadRequestError) as e:
            await c.completions.create(model="m", prompt="def add(a, b):\n    return ", suffix="\n", max_tokens=8)
        infill = await h.post("/infill", json={"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n"})
        echo = await c.completions.create(model="m", prompt=PROMPT, echo=True, max_tokens=0)
        pieces = (await h.post("/tokenize", json={"content": PROMPT, "with_pieces": True})).json()
        return e.value, infill, echo, pieces

    refused, infill, echo, pieces = call(reference, fn)
    assert refused.status_code == 400 and "<fim_prefix>" in refused.message and refused.param == "suffix"
    assert infill.status_code == 400 and infill.json()["error"]["param"] == "input_prefix"
    assert echo.choices[0].text == PROMPT and echo.usage.completion_tokens == 0
    assert "".join(p["piece"] for p in pieces["tokens"]) == PROMPT


# ---- lm-evaluation-harness against a real HTTP server ----

@pytest.fixture(scope="module")
def http_server(reference):
    """The app over the reference model, served by uvicorn on a free loopback port from a thread: its base URL.
    (Float weights: with int4 codes each linear rounds its input to bf16, and the last-bit differences between a
    paged and an uncached forward grow to ~0.1 in the logits, so there the two agree only that far.)"""
    import socket
    import threading

    import uvicorn

    model, tokenizer = reference
    app = make_app(Engine(model, tokenizer, EngineConfig(num_blocks=256, max_running=8)), tokenizer, "m")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # log_config=None: uvicorn would configure logging for the whole process (its loggers stop propagating, and
    # the other tests' caplog sees nothing)
    http = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    while not http.started:
        assert thread.is_alive(), "uvicorn did not start"
        threading.Event().wait(0.05)
    yield f"http://127.0.0.1:{port}"
    http.should_exit = True
    thread.join(timeout=30)


@pytest.mark.slow
def test_lm_eval_loglikelihoods_equal_the_models(reference, http_server, monkeypatch):
    """lm-eval's local-completions (echo + logprobs over token lists, its tokenizer read from /tokenize) runs a
    multiple-choice and a perplexity task from tests/data/lm_eval; every log-likelihood it got equals the
    in-process model's teacher-forced one within 1e-4."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    model, tok = reference
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.chdir(root)  # the tasks' data_files are relative to the repository
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model=m,base_url={http_server}/v1/completions,tokenizer_backend=remote,tokenized_requests=True,"
                   "num_concurrent=1,max_retries=1,batch_size=4",
        tasks=["tinyllm_mc", "tinyllm_ppl"], task_manager=TaskManager(include_path="tests/data/lm_eval"),
        log_samples=True)
    assert out["results"]["tinyllm_mc"]["acc,none"] >= 0.6  # a real model gets the easy ones right
    # lm-eval's prefix token before a rolling window: the tokenizer's BOS (/tokenizer_info names one), else EOS
    prefix = tok.encode(tok.bos_token or tok.eos_token, bos=False)
    for sample in out["samples"]["tinyllm_mc"]:
        for (context, continuation), [(ll, _)] in zip(sample["arguments"], sample["resps"]):
            ctx, cont = lm_eval_pair(tok, context, continuation)
            want = sum(teacher_forced(model, ctx + cont)[len(ctx) - 1:])
            assert abs(ll - want) < 1e-4, (context, continuation, ll, want)
    for sample in out["samples"]["tinyllm_ppl"]:
        ids = tok.encode(sample["doc"]["text"], bos=False)
        want = sum(teacher_forced(model, prefix + ids))  # one window, after the prefix token
        assert abs(sample["resps"][0][0] - want) < 1e-4


def lm_eval_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a (context, continuation) into tokens: trailing spaces go to the continuation, the
    whole is encoded and cut after the context's tokens."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, ctx = tok.encode(context + continuation, bos=False), tok.encode(context, bos=False)
    return ctx, whole[len(ctx):]


# ---- tool calling ----

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 30},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
BOOK = {"type": "function", "function": {
    "name": "book_table", "description": "Book a table at a restaurant.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["restaurant", "people", "time"],
                   "properties": {"restaurant": {"type": "string", "maxLength": 40},
                                  "people": {"type": "integer", "minimum": 1, "maximum": 20},
                                  "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}}}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["query"],
                   "properties": {"query": {"type": "string", "maxLength": 60},
                                  "max_results": {"type": "integer", "minimum": 1, "maximum": 10},
                                  "safe": {"type": "boolean"}}}}}
TOOL_PROMPTS = ["What's the weather in Paris?", "Is it cold in Oslo today?", "Book a table for 4 at Luigi's at 19:30.",
                "Find me recent news about volcanoes.", "I need a dinner reservation for two at 8pm.",
                "Should I take an umbrella in London?", "Look up the population of Japan.",
                "Weather in Tokyo in fahrenheit please.", "Search for a good pancake recipe.",
                "Reserve a table for 12 people at Noma, 18:00."]


def test_named_and_required_tool_calls_are_valid_by_construction(reference):
    """10 prompts x 3 schemas with the function named, and 6 prompts with "required" over all three, sampled at
    temperature 0.8: every call parses and its arguments validate against the function's schema."""
    import json

    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, BOOK, SEARCH)}

    async def one(c, prompt, seed, choice):
        # parallel_tool_calls false: one call each (with several allowed, a sampled "required" may go on calling)
        r = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}],
                                            tools=[WEATHER, BOOK, SEARCH], tool_choice=choice, temperature=0.8,
                                            seed=seed, max_tokens=250, parallel_tool_calls=False)
        return r.choices[0]

    async def fn(c, h):
        named = [one(c, p, i, {"type": "function", "function": {"name": name}})
                 for i, p in enumerate(TOOL_PROMPTS) for name in schemas]
        required = [one(c, p, i, "required") for i, p in enumerate(TOOL_PROMPTS[:6])]  # (and test_tools.py's)
        return await asyncio.gather(*named), await asyncio.gather(*required)

    named, required = call(reference, fn)
    names = [name for _ in TOOL_PROMPTS for name in schemas]
    for choice, name in zip(named, names):
        assert choice.finish_reason == "tool_calls", choice
        (tool_call,) = choice.message.tool_calls
        assert tool_call.type == "function" and tool_call.function.name == name and tool_call.id
        jsonschema.validate(json.loads(tool_call.function.arguments), schemas[name])
    for choice in required:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
        tool_call = choice.message.tool_calls[0]
        jsonschema.validate(json.loads(tool_call.function.arguments), schemas[tool_call.function.name])


def test_tool_calls_stream_and_round_trip(reference):
    """Streaming: the id and name come first, then argument fragments that join to the whole answer's arguments;
    auto may answer in text or call; a full round trip (call -> tool message -> answer) is rendered and answered."""
    import json

    weather = {"type": "function", "function": {"name": "get_weather"}}
    ask = [{"role": "user", "content": "What's the weather in Paris?"}]

    async def fn(c, h):
        kw = dict(model="m", messages=ask, tools=[WEATHER], tool_choice=weather, temperature=0, max_tokens=80)
        whole = await c.chat.completions.create(**kw)
        chunks = [x async for x in await c.chat.completions.create(stream=True, **kw)]
        auto = await c.chat.completions.create(model="m", messages=ask, tools=[WEATHER, SEARCH], temperature=0,
                                               max_tokens=80)
        tool_call = whole.choices[0].message.tool_calls[0]
        history = ask + [{"role": "assistant", "content": None, "tool_calls": [tool_call.model_dump()]},
                         {"role": "tool", "tool_call_id": tool_call.id, "content": '{"temperature": 21}'}]
        final = await c.chat.completions.create(model="m", messages=history, tools=[WEATHER], temperature=0,
                                                max_tokens=40)
        bad = await h.post("/v1/chat/completions", json={"messages": ask + [
            {"role": "tool", "tool_call_id": "call_nope", "content": "1"}], "tools": [WEATHER]})
        absent = await h.post("/v1/chat/completions", json={"messages": ask, "tools": [WEATHER],
                                                            "tool_choice": {"type": "function",
                                                                            "function": {"name": "fly"}}})
        return whole, chunks, auto, final, bad, absent

    whole, chunks, auto, final, bad, absent = call(reference, fn)
    deltas = [d for x in chunks if x.choices for d in (x.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].index == 0
    arguments = whole.choices[0].message.tool_calls[0].function.arguments
    assert "".join(d.function.arguments or "" for d in deltas) == arguments
    assert [x.choices[0].finish_reason for x in chunks if x.choices][-1] == "tool_calls"
    json.loads(whole.choices[0].message.tool_calls[0].function.arguments)
    a = auto.choices[0]
    assert (a.finish_reason == "tool_calls") == bool(a.message.tool_calls)
    assert a.message.content or a.message.tool_calls
    assert final.choices[0].message.content and final.choices[0].finish_reason in ("stop", "length")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[1].tool_call_id"
    assert absent.status_code == 400 and absent.json()["error"]["param"].startswith("tool_choice")


CITY = {"type": "function", "function": {  # as agents write one: no bounds on the string
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_required_ends_after_its_call_by_default(reference):
    """tool_choice "required" without parallel_tool_calls: SmolLM2's template has no parallel calls, so one call,
    and the grammar ends the output after it (it ran to max_tokens repeating calls before). Temperature 0 (greedy:
    the seed changes nothing) and 5 seeds at 0.7. With parallel calls asked for, a repeated call ends the output and
    is dropped."""
    import json

    async def one(c, temperature, seed, **kw):
        r = await c.chat.completions.create(model="m", messages=ASK_WEATHER, tools=[CITY], tool_choice="required",
                                            temperature=temperature, seed=seed, max_tokens=200, **kw)
        return r.choices[0]

    async def fn(c, h):
        return await asyncio.gather(one(c, 0, 0), *[one(c, 0.7, seed) for seed in range(5)],
                                    one(c, 0, 0, parallel_tool_calls=True))

    *choices, parallel = call(reference, fn)
    for choice in choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
        assert isinstance(json.loads(choice.message.tool_calls[0].function.arguments)["city"], str)
    assert parallel.finish_reason == "tool_calls", parallel
    calls = [(t.function.name, json.loads(t.function.arguments)) for t in parallel.message.tool_calls]
    assert len(set(map(json.dumps, calls))) == len(calls), calls


def test_tools_with_a_response_format(reference):
    """tools with response_format (the OpenAI Agents SDK sends both for an agent with an output_type): 200, and
    each answer is a call or content valid under the schema, streamed or not; tool_choice none: the format alone."""
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 80}},
              "required": ["answer"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "Answer", "schema": schema, "strict": True}}
    asks = [ASK_WEATHER, [{"role": "user", "content": "Say hello to Ana."}]]

    async def fn(c, h):
        kw = dict(model="m", tools=[CITY], response_format=fmt, max_tokens=120, seed=1)
        whole = [await c.chat.completions.create(messages=m, temperature=t, **kw) for m in asks for t in (0, 0.7)]
        stream = await c.chat.completions.create(messages=asks[1], temperature=0, stream=True, **kw)
        answer = await c.chat.completions.create(messages=asks[1], temperature=0, tool_choice="none", **kw)
        return whole + [answer], [x async for x in stream]

    whole, chunks = call(reference, fn)  # SmolLM2 calls in auto mode; with "none" it answers in the format
    assert whole[-1].choices[0].message.content and not whole[-1].choices[0].message.tool_calls
    for r in whole:
        choice = r.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls", choice
            json.loads(choice.message.tool_calls[0].function.arguments)
        else:
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.message.content), schema)
    streamed = "".join(x.choices[0].delta.content or "" for x in chunks if x.choices)
    assert streamed == (whole[2].choices[0].message.content or "")  # the same request, not streamed


def test_instructor_and_langchain_tool_calling(reference):
    """The libraries' own tool paths: instructor's default Mode.TOOLS returns a validated pydantic object;
    langchain-openai's bind_tools (with tool_choice) returns tool_calls and with_structured_output(method=
    "function_calling") returns the object."""
    import instructor
    import pydantic
    from langchain_openai import ChatOpenAI

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=30)
        country: str = pydantic.Field(max_length=30)
        population_millions: float = pydantic.Field(ge=0, le=100)

    async def fn(c, h):
        client = instructor.from_openai(c)  # Mode.TOOLS
        chat = ChatOpenAI(model="m", base_url=f"{LOCAL}/v1", api_key="x", temperature=0, max_tokens=100,
                          http_async_client=h, max_retries=0)
        return await asyncio.gather(  # at once: the engine batches the three
            client.chat.completions.create(model="m", response_model=City, max_tokens=100, temperature=0,
                                           messages=[{"role": "user", "content": "Describe Paris."}]),
            chat.bind_tools([WEATHER], tool_choice="get_weather").ainvoke("Weather in Rome?"),
            chat.with_structured_output(City, method="function_calling").ainvoke("Describe Rome."))

    city, bound, structured = call(reference, fn)
    assert isinstance(city, City) and isinstance(structured, City)
    assert bound.tool_calls and bound.tool_calls[0]["name"] == "get_weather" and "city" in bound.tool_calls[0]["args"]


def test_max_model_len_caps_a_request_and_served_names_come_from_the_flags(reference):
    from serve import parse_args, serve_config

    config = serve_config(parse_args(["--served-model-name", "main", "other", "--max-model-len", "64"]))
    assert (config.aliases, config.max_model_len) == (("other",), 64)

    async def fn(c, h):
        fits = await c.completions.create(model="m", prompt=PROMPT, max_tokens=8, temperature=0)
        with pytest.raises(openai.BadRequestError) as e:
            await c.completions.create(model="m", prompt=PROMPT, max_tokens=60, temperature=0)
        info = (await h.get("/v1/models/m")).json()
        return fits, e.value, info

    fits, refused, info = call(reference, fn, max_model_len=64)
    assert fits.usage.completion_tokens == 8
    assert refused.status_code == 400 and "max_tokens" in refused.message
    assert info["max_model_len"] == 64


def test_a_chat_streams_first_chunk_goes_out_with_the_first_token(reference):
    """The role chunk waits for the prefill: a ~400-token prompt's first chunk (its prefill 7 steps of the token
    budget's 64) arrives once the engine has sampled a token (the server's TTFT histogram has counted it), so every
    client measures the same TTFT."""
    model, tok = reference
    long = " ".join(["The quick brown fox jumps over the lazy dog."] * 40)

    async def fn(c, h):
        metrics = h._transport.app.state.server.metrics
        stream = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": long}],
                                                 max_tokens=2, temperature=0, stream=True)
        seen = []
        async for chunk in stream:
            seen.append((sum(metrics.ttft.counts), chunk.choices[0].delta.role if chunk.choices else None))
        return seen

    assert len(tok.encode(long)) > 6 * 64
    seen = call(reference, fn)
    assert seen[0] == (1, "assistant")  # the first token was already sampled when the role went out
