"""grammar.py, structured output: the token table read from byte-level and sentencepiece vocabularies, a masked
step that changes nothing but the forbidden tokens, EOS only where the grammar may end, a matcher per batch row and
engine sequence; on SmolLM2 (slow), 15 prompts x 3 schemas at temperature 0.8 that all validate, regexes that
fullmatch and an arithmetic grammar that holds."""
import json
import re

import jsonschema
import pytest
import torch

from decode import generate, generate_batch
from serving.engine import Engine, EngineConfig, Request
from features.constraint import Constraint, check_constraint
from features.grammar import Compiler, allowed, mask_logits, token_bytes
from helpers import toy_bpe
from params import SamplingParams
from text import complete, complete_batch
from tokenizer import tokenizer_from_gguf_metadata

VOCAB = 160  # the tiny model's logits: wider than the toy tokenizer, whose extra ids must never be allowed
PEOPLE = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}}}
ARITHMETIC_GBNF = r'''root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9] | "(" expr ")"
'''
# A bounded one, so that sampling always completes it: up to three terms, each a number or a parenthesized pair.
ARITHMETIC_BOUNDED = r'''root ::= term | term op term | term op term op term
term ::= num | "(" num op num ")"
num ::= [1-9] [0-9]?
op ::= " + " | " - " | " * " | " / "
'''
ARITHMETIC_LARK = r'''start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: /[0-9]/ | "(" expr ")"
'''


@pytest.fixture(scope="module")
def toy():
    """A byte-level BPE tokenizer of printable ASCII and a few merges (103 ids), EOS id 0 (helpers.toy_bpe)."""
    return toy_bpe()


@pytest.fixture(scope="module")
def compiler(toy):
    return Compiler(toy, VOCAB)


def sentencepiece_toy():
    """A sentencepiece vocabulary: <unk>, <s>, </s>, the 256 byte tokens, and a few pieces with '▁'."""
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "▁a", "b", "▁ab", "{", "\""]
    types = [2, 3, 3, *[6] * 256, *[1] * 6]
    return tokenizer_from_gguf_metadata({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": pieces,
                                         "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": [0.0] *
                                         len(pieces), "tokenizer.ggml.bos_token_id": 1,
                                         "tokenizer.ggml.eos_token_id": 2})


# ---- the vocabulary ----

@pytest.mark.parametrize("name", ["toy", "sentencepiece", "smollm2"])
def test_token_bytes_concatenate_to_the_text(name, toy, smollm2_tokenizer):
    tokenizer = {"toy": toy, "sentencepiece": sentencepiece_toy(), "smollm2": smollm2_tokenizer}[name]
    tokens, special = token_bytes(tokenizer, tokenizer.vocab_size + 3)
    text = 'ab {"a": [true, 12]} é\n' if name != "toy" else '{"ab": [true, 12]}'
    ids = tokenizer.encode(text, bos=False)
    got = b"".join(tokens[i] for i in ids)
    # sentencepiece writes a leading '▁' before the text (its dummy prefix), which decode drops
    assert got == (b" " if name == "sentencepiece" else b"") + text.encode("utf-8"), (got, ids)
    assert set(tokenizer.eos_ids) <= set(special)
    assert all(tokens[i] == b"\xff" + tokenizer.backend.id_to_token(i).encode() for i in special
               if i < tokenizer.vocab_size)  # llguidance's mark of a special token: no text matches it
    assert special[-3:] == [tokenizer.vocab_size + k for k in range(3)]  # ids past the vocabulary: never allowed
    assert all(tokens[i] == b"" for i in special[-3:])


# ---- the mask ----

def test_masked_step_equals_the_unmasked_one_on_allowed_tokens(tiny, toy, compiler):
    grammar = compiler.compile(Constraint("json_schema", json.dumps(PEOPLE)))
    matcher = grammar.matcher()
    prompt = toy.encode("ab", bos=False)
    logits = tiny(torch.tensor([prompt, prompt]), torch.arange(len(prompt)))[:, -1]  # (2, V)
    for token in toy.encode('{"name": "ab', bos=False):
        matcher.advance(token)
    masked = mask_logits(logits, [matcher, None])  # row 1 has no grammar
    ok = allowed(matcher, VOCAB)
    assert torch.equal(masked[0, ok], logits[0, ok])  # bit for bit
    assert torch.isneginf(masked[0, ~ok]).all()
    assert torch.equal(masked[1], logits[1])
    # After '{"name": "ab' come up to 4 more lowercase letters or the closing quote, and nothing else.
    want = ['"', '",', "tr", "tru", "true", *"abcdefghijklmnopqrstuvwxyz"]
    assert sorted(toy.decode([i]) for i in ok.nonzero()[:, 0].tolist()) == sorted(want)


def test_eos_only_where_the_grammar_may_end(toy, compiler):
    matcher = compiler.compile(Constraint("regex", "[0-9]{2,3}")).matcher()
    eos = toy.eos_ids[0]
    digits = toy.encode("1", bos=False)
    assert not allowed(matcher, VOCAB)[eos]
    matcher.advance(digits[0])
    assert not allowed(matcher, VOCAB)[eos] and not matcher.can_end
    matcher.advance(digits[0])
    assert allowed(matcher, VOCAB)[eos] and matcher.can_end and not matcher.done
    matcher.advance(digits[0])
    assert matcher.done and allowed(matcher, VOCAB).nonzero()[:, 0].tolist() == [eos]  # only EOS is left
    matcher.rollback(2)
    assert not matcher.can_end and not allowed(matcher, VOCAB)[eos]


def test_compiled_grammars_are_cached_and_bad_ones_are_one_line_errors(compiler):
    a = compiler.compile(Constraint("regex", "[a-z]+"))
    assert compiler.compile(Constraint("regex", "[a-z]+")) is a
    assert a.matcher().matcher is not a.matcher().matcher  # a matcher per sequence
    for constraint, fragment in [(Constraint("regex", "[a-"), "invalid regex"),
                                 (Constraint("json_schema", '{"type": "objekt"}'), "invalid json schema"),
                                 (Constraint("grammar", "root ::= nothing"), "invalid GBNF grammar"),
                                 (Constraint("grammar", "start: nothing"), "invalid grammar")]:
        for check in (check_constraint, compiler.compile):
            with pytest.raises(ValueError, match=fragment) as e:
                check(constraint)
            assert "\n" not in str(e.value)


@pytest.mark.parametrize("constraint, fragment", [
    (Constraint("json_schema", '{"$ref": "#"}'), "invalid json schema: no text matches it"),
    (Constraint("regex", "[^\\x00-\\x{10FFFF}]"), "invalid regex: no text matches it"),
    (Constraint("grammar", "start: start"), "invalid grammar: no text matches it"),
    (Constraint("regex", "a{1000}{1000}"), "invalid regex: lexer error: too many expressions constructed"),
    (Constraint("grammar", "start: " + " | ".join(f'"c{i}"' for i in range(2500))), "2501 items; max is 2000"),
])
def test_specs_that_compile_but_cannot_be_followed_fail_at_compile(toy, constraint, fragment):
    """llguidance accepts these and failed at the first mask or token, with its parser state in an AssertionError:
    compile() tries the first steps, and the ValueError is one line without the state. It is cached too."""
    check_constraint(constraint)  # valid to llguidance without a vocabulary
    compiler = Compiler(toy, VOCAB)
    for _ in range(2):
        with pytest.raises(ValueError, match=re.escape(fragment)) as e:
            compiler.compile(constraint)
        assert "\n" not in str(e.value) and "<" not in str(e.value) and len(str(e.value)) <= 320
    assert isinstance(compiler.cache[constraint], ValueError)


def test_choices_as_one_terminal_take_10000(tiny, toy, compiler):
    """serve.py's guided_choice: as alternatives of a rule, over 2,000 choices are refused (above); as one
    terminal 10,000 compile, and the text is exactly one of them."""
    choices = [f"{i}" for i in range(10_000)]
    grammar = compiler.compile(Constraint("grammar", "start: CHOICE\nCHOICE: " + " | ".join(map(json.dumps, choices))))
    for seed in range(3):
        c = constrained(tiny, toy, grammar, "n=", 8, SamplingParams(temperature=1.0), seed)
        assert c.text in choices and c.finish_reason in ("stop", "eos"), c.text


def test_a_grammar_failing_mid_generation_is_a_one_line_value_error(toy, compiler):
    """A token the grammar cannot take (here: one the mask forbids) raises a ValueError, not an AssertionError
    with llguidance's state; the engine ends that request alone with it."""
    matcher = compiler.compile(Constraint("regex", "[a-z]+")).matcher()
    with pytest.raises(ValueError, match="grammar failed at token") as e:
        matcher.advance(toy.encode("{", bos=False)[0])
    assert "\n" not in str(e.value) and "<" not in str(e.value)
    with pytest.raises(ValueError, match="grammar failed"):
        allowed(matcher, VOCAB)


# ---- generation on the tiny random model ----

def constrained(tiny, toy, grammar, prompt: str, n: int, params: SamplingParams, seed: int = 0, **kw):
    ids = toy.encode(prompt, bos=False)
    tokens = generate(tiny, ids, max_new_tokens=n, params=params, generator=torch.Generator().manual_seed(seed),
                      stop_ids=toy.eos_ids, grammar=grammar, **kw)
    return complete(tokens, toy, len(ids))


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.5),
                                    SamplingParams(temperature=1.0, top_k=3, top_p=0.9, min_p=0.05),
                                    SamplingParams(temperature=0.8, repetition_penalty=1.3, presence_penalty=1.0)])
def test_random_model_outputs_validate(tiny, toy, compiler, params):
    grammar = compiler.compile(Constraint("json_schema", json.dumps(PEOPLE)))
    for seed in range(4):
        c = constrained(tiny, toy, grammar, "ab", 60, params, seed)
        assert c.finish_reason in ("stop", "eos"), c
        jsonschema.validate(json.loads(c.text), PEOPLE)


def test_regex_and_both_grammar_formats_hold(tiny, toy, compiler):
    for constraint, pattern in [(Constraint("regex", r"(ab|c)[0-9]{1,3}-[xyz]+"), r"(ab|c)[0-9]{1,3}-[xyz]+"),
                                (Constraint("grammar", ARITHMETIC_GBNF), None),
                                (Constraint("grammar", ARITHMETIC_LARK), None)]:
        grammar = compiler.compile(constraint)
        for seed in range(4):
            c = constrained(tiny, toy, grammar, "1", 40, SamplingParams(temperature=1.0), seed)
            if pattern is not None:
                assert re.fullmatch(pattern, c.text) and c.finish_reason in ("stop", "eos"), c
            elif c.finish_reason != "length":
                assert re.fullmatch(r"[0-9()+\-*/]+", c.text) and c.text.count("(") == c.text.count(")"), c
                compile(c.text, "<expr>", "eval")  # Python parses it


def test_schema_admitting_one_string_yields_exactly_it(tiny, toy, compiler):
    value = {"name": "true", "n": [12, 1.5, None], "ok": True}
    grammar = compiler.compile(Constraint("json_schema", json.dumps({"const": value})))
    for params in (SamplingParams(), SamplingParams(temperature=2.0)):
        c = constrained(tiny, toy, grammar, "ab", 80, params)
        assert c.text == json.dumps(value) and c.finish_reason == "stop"  # ended when only EOS could follow


def test_min_tokens_holds_eos_until_the_grammar_alone_ends_it(tiny, toy, compiler):
    """min_tokens holds EOS back while the grammar allows more (a bias toward EOS would end at once), but a grammar
    that is complete wins: no deadlock, however large min_tokens is."""
    letters = compiler.compile(Constraint("regex", "[a-c]+"))
    eos = toy.eos_ids[0]
    c = constrained(tiny, toy, letters, "ab", 20, SamplingParams(logit_bias=((eos, 100),)))
    assert len(c.text) == 1 and c.finish_reason == "eos"  # EOS as soon as the grammar allows it
    c = constrained(tiny, toy, letters, "ab", 20, SamplingParams(logit_bias=((eos, 100),), min_tokens=6))
    assert re.fullmatch("[a-c]{6}", c.text) and len(c.tokens) == 7 and c.finish_reason == "eos"
    value = {"ok": True}
    one = compiler.compile(Constraint("json_schema", json.dumps({"const": value})))
    for params in (SamplingParams(min_tokens=50), SamplingParams(min_tokens=50, ignore_eos=True),
                   SamplingParams(temperature=1.0, min_tokens=50, logit_bias=((eos, 100),))):
        c = constrained(tiny, toy, one, "ab", 80, params)
        assert c.text == json.dumps(value) and c.finish_reason == "stop"


def test_length_mid_structure_keeps_the_text(tiny, toy, compiler):
    grammar = compiler.compile(Constraint("json_schema", json.dumps(PEOPLE)))
    c = constrained(tiny, toy, grammar, "ab", 5, SamplingParams(temperature=1.0))
    assert c.finish_reason == "length" and len(c.tokens) == 5
    assert c.text == toy.decode(c.tokens) == '{"name'  # as generated: no closing brackets invented


def test_logprobs_are_the_constrained_distribution(tiny, toy, compiler):
    grammar = compiler.compile(Constraint("regex", "[a-c]{3}"))
    c = constrained(tiny, toy, grammar, "ab", 3, SamplingParams(temperature=1.0), logprobs=VOCAB)
    for step in c.steps:
        assert {toy.decode([i]) for i, _ in step.top} == {"a", "b", "c"}
        assert sum(torch.tensor([v for _, v in step.top]).exp()) == pytest.approx(1.0, abs=1e-5)


def test_batch_rows_and_engine_sequences_have_their_own_matchers(tiny, toy, compiler):
    """Greedy: a batch, the engine and one prompt at a time give the same constrained outputs."""
    grammar = compiler.compile(Constraint("json_schema", json.dumps(PEOPLE)))
    prompts = [toy.encode(p, bos=False) for p in ["ab", "hello there", "x", "1 2 3 4 5"]]
    alone = [[t.id for t in generate(tiny, p, max_new_tokens=40, stop_ids=toy.eos_ids, grammar=grammar)]
             for p in prompts]
    rows = generate_batch(tiny, prompts, max_new_tokens=40, stop_ids=toy.eos_ids, grammar=grammar)
    batch = complete_batch(rows, toy, [len(p) for p in prompts])
    engine = Engine(tiny, toy, EngineConfig(num_blocks=64, max_running=4, token_budget=64))
    served = engine.generate(prompts, max_new_tokens=40, grammar=grammar)
    for a, b, s in zip(alone, batch, served):
        assert b.tokens == a and s.tokens == a
        jsonschema.validate(json.loads(b.text), PEOPLE)
    sampled = engine.generate(prompts, SamplingParams(temperature=1.0), max_new_tokens=40, seed=1, grammar=grammar)
    for s in sampled:
        jsonschema.validate(json.loads(s.text), PEOPLE)


def test_each_engine_choice_has_its_own_matcher(tiny, toy, compiler):
    """n = 3, sampled: choice i follows the grammar with a matcher of its own, as decode.generate does with seed + i."""
    grammar = compiler.compile(Constraint("json_schema", json.dumps(PEOPLE)))
    prompt = toy.encode("hello there", bos=False)
    params = SamplingParams(temperature=1.0)
    engine = Engine(tiny, toy, EngineConfig(num_blocks=64, max_running=4, token_budget=64))
    events = []
    engine.submit(Request(prompt, params, 40, seed=1, on_event=events.append, grammar=grammar, n=3))
    while engine.step():
        pass
    for i in range(3):
        alone = [t.id for t in generate(tiny, prompt, max_new_tokens=40, params=params,
                                        generator=torch.Generator().manual_seed(1 + i), stop_ids=toy.eos_ids,
                                        grammar=grammar)]
        assert [t for e in events if e.index == i for t in e.token_ids] == alone
        jsonschema.validate(json.loads("".join(e.text for e in events if e.index == i)), PEOPLE)


def test_unconstrained_generation_is_unchanged(tiny, toy, compiler):
    """A request without a grammar decodes as before, beside one with a grammar in the same engine batch."""
    prompt = toy.encode("hello", bos=False)
    plain = [t.id for t in generate(tiny, prompt, max_new_tokens=12, stop_ids=toy.eos_ids)]
    engine = Engine(tiny, toy, EngineConfig(num_blocks=64, max_running=4, token_budget=64))
    engine.submit(Request(prompt, max_new_tokens=12, grammar=compiler.compile(Constraint("json_object"))))
    (c,) = engine.generate([prompt], max_new_tokens=12)
    assert c.tokens == plain


# ---- SmolLM2: the acceptance tests ----

PROMPTS = [
    "Describe a person you know.", "Invent a character for a novel.", "Who is the main character of your story?",
    "Tell me about a scientist.", "Create a user profile.", "Describe a teacher.", "Make up a pilot.",
    "Describe your neighbour.", "Give me a random person.", "Tell me about an athlete.", "Describe a chef.",
    "Who won the race?", "Describe a painter.", "Create a game character.", "Tell me about a doctor.",
]
SCHEMAS = [
    {"type": "object", "additionalProperties": False, "required": ["name", "age", "role"],
     "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"},
                    "age": {"type": "integer", "minimum": 1, "maximum": 99},
                    "role": {"enum": ["teacher", "pilot", "chef", "doctor", "other"]}}},
    {"type": "object", "additionalProperties": False, "required": ["id", "tags", "score"],
     "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1,
                             "maxItems": 3},
                    "score": {"type": "number", "minimum": 0, "maximum": 10}}},
    {"type": "object", "additionalProperties": False, "required": ["person", "active"],
     "properties": {"person": {"type": "object", "additionalProperties": False, "required": ["first", "city"],
                               "properties": {"first": {"type": "string", "maxLength": 10},
                                              "city": {"enum": ["Paris", "Rome", "Oslo", "Lima"]}}},
                    "active": {"type": "boolean"},
                    "level": {"type": "integer", "minimum": 1, "maximum": 5}}},
]


def chat_prompts(tokenizer, suffix: str) -> list[list[int]]:
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p + suffix}]), bos=False)
            for p in PROMPTS]


@pytest.mark.slow
@pytest.mark.parametrize("schema", range(len(SCHEMAS)))
def test_smollm2_15_prompts_validate_at_temperature_0_8(smollm2, schema):
    model, tokenizer = smollm2
    compiler = Compiler(tokenizer, model.args.vocab_size)
    grammar = compiler.compile(Constraint("json_schema", json.dumps(SCHEMAS[schema])))
    prompts = chat_prompts(tokenizer, " Answer in JSON.")
    rows = generate_batch(model, prompts, max_new_tokens=72, params=SamplingParams(temperature=0.8),
                          generator=torch.Generator().manual_seed(schema), stop_ids=tokenizer.eos_ids, grammar=grammar)
    for c in complete_batch(rows, tokenizer, [len(p) for p in prompts]):
        assert c.finish_reason in ("stop", "eos"), c.text
        jsonschema.validate(json.loads(c.text), SCHEMAS[schema])


@pytest.mark.slow
def test_smollm2_regex_grammar_and_one_string(smollm2):
    model, tokenizer = smollm2
    compiler = Compiler(tokenizer, model.args.vocab_size)
    prompts = chat_prompts(tokenizer, "")[:10]
    pattern = r"[A-Z][a-z]+ (is|was) [0-9]{1,3} years old\."
    for constraint, check in [(Constraint("regex", pattern), lambda t: re.fullmatch(pattern, t)),
                              (Constraint("grammar", ARITHMETIC_BOUNDED),
                               lambda t: re.fullmatch(r"[0-9()+\-*/ ]+", t) and compile(t, "<expr>", "eval"))]:
        rows = generate_batch(model, prompts, max_new_tokens=40, params=SamplingParams(temperature=0.8),
                              generator=torch.Generator().manual_seed(0), stop_ids=tokenizer.eos_ids,
                              grammar=compiler.compile(constraint))
        for c in complete_batch(rows, tokenizer, [len(p) for p in prompts]):
            assert c.finish_reason in ("stop", "eos") and check(c.text), c.text
    value = {"answer": "Paris", "sure": True}
    grammar = compiler.compile(Constraint("json_schema", json.dumps({"const": value})))
    c = complete(generate(model, prompts[0], max_new_tokens=40, params=SamplingParams(temperature=0.8),
                          generator=torch.Generator().manual_seed(0), stop_ids=tokenizer.eos_ids, grammar=grammar),
                 tokenizer, len(prompts[0]))
    assert c.text == json.dumps(value) and c.finish_reason == "stop"
