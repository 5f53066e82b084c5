"""The OpenAI protocol's requests, without a server: a request body -> a Call (the engine Requests to submit and
how to answer them), /tokenize and /detokenize bodies, errors in OpenAI's format; BadRequest names the field at
fault. Pure functions, testable without HTTP, torch or the model (answer.py shapes the answers; app.py does the
HTTP)."""
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from features.constraint import Constraint, Grammar, check_constraint
from features.reasoning import Tags, opens_thinking
from features.fim import FimTokens, find_fim_tokens, infill_prompt
from features.tools import ToolRequest, field_of, tool_request
from params import SamplingParams, check_logit_bias, fit_new_tokens
from serving.contract import Request
from text import check_stop

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to all the room left
MAX_LOGPROBS = 20  # alternatives per token at most (OpenAI's top_logprobs limit; completions' logprobs as vLLM)
MAX_CHOICES = 64  # n (or best_of) at most, and prompts x n per call: each is a sequence decoded in the batch
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
# Structured output: OpenAI's response_format, and vLLM's extensions (guided_json, guided_regex, guided_grammar,
# guided_choice); at most one of them per request.
GUIDED = ("response_format", "guided_json", "guided_regex", "guided_grammar", "guided_choice")
# The fields read; any other is ignored with a log line (as vLLM does: SDKs send fields a server may not know).
# top_k, min_p, repetition_penalty, min_tokens, ignore_eos and guided_* are vLLM's extensions.
COMMON_FIELDS = {"model", "user", "max_tokens", "stop", "seed", "stream", "stream_options", "n", "logprobs",
                 "logit_bias", "min_tokens", "ignore_eos", *SAMPLING, *GUIDED}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                               "parallel_tool_calls", "chat_template_kwargs"}
# The variables a chat template is rendered with by the server: chat_template_kwargs may not replace them
TEMPLATE_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token")
# Not served: the deprecated functions/function_call (tools replace them); on completions, tool calling.
NOT_SERVED = ("functions", "function_call")
JSON_KINDS = {"number": (int, float), "integer": (int,), "string": (str,), "boolean": (bool,), "object": (dict,),
              "array": (list,)}


class BadRequest(ValueError):
    """A request answered with HTTP 400; param names the offending field when there is one."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def get(body: dict, name: str, kind: str, default=None):
    """body[name] checked to be of JSON type `kind` (a boolean is no number); default when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, JSON_KINDS[kind]) or (isinstance(value, bool) and kind != "boolean"):
        article = "an" if kind[0] in "aeio" else "a"
        raise BadRequest(f"{name} must be {article} {kind}, got {json.dumps(value)[:50]}", name)
    if kind == "number" and isinstance(value, int) and not -2 ** 1023 < value < 2 ** 1023:
        # JSON integers are unbounded: 10**400 as a temperature would overflow converting to a float
        raise BadRequest(f"{name} is out of range, got a number of {len(str(abs(value)))} digits", name)
    return value


def sampling_params(body: dict, vocab_size: int, preset: dict | None = None) -> SamplingParams:
    """The sampling fields of a request; for those left out, preset's (the model's generation_config.json, as vLLM)
    or OpenAI's defaults (temperature 1). logit_bias maps token ids (as strings, JSON's keys) to a bias in
    [-100, 100] added to their logits."""
    defaults = SamplingParams(**{"temperature": 1.0, **(preset or {})})
    values = {name: get(body, name, "integer" if name == "top_k" else "number", getattr(defaults, name))
              for name in SAMPLING}
    bias = [(int(key) if key.isdigit() else key, value)  # JSON's keys are strings; params.py checks the rest
            for key, value in get(body, "logit_bias", "object", {}).items()]
    min_tokens = get(body, "min_tokens", "integer", 0)
    ignore_eos = get(body, "ignore_eos", "boolean", False)
    try:
        check_logit_bias(bias, vocab_size)
        return SamplingParams(**values, logit_bias=tuple(bias), min_tokens=min_tokens, ignore_eos=ignore_eos)
    except ValueError as e:  # its messages start with the parameter's name
        name = str(e).split()[0]
        raise BadRequest(str(e), name if name in (*SAMPLING, "logit_bias", "min_tokens") else None) from None


def check_unicode(body) -> None:
    """BadRequest for a lone surrogate anywhere in body: JSON can escape one ("\\ud800") but it is no text (UTF-8
    cannot encode it), so neither the tokenizer nor a response could take it. Iterative: bodies may nest deeply."""
    stack = [(body, None)]
    while stack:
        value, param = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise BadRequest(f"{param or 'the request'} contains a lone UTF-16 surrogate escape "
                                 "(\\ud800-\\udfff not in a pair), which is not text", param) from None
        elif isinstance(value, dict):
            for k, v in value.items():
                field_ = param or (k if k in CHAT_FIELDS or k in COMPLETION_FIELDS else None)  # known: safe to echo
                stack += [(k, field_), (v, field_)]
        elif isinstance(value, list):
            stack += [(v, param) for v in value]


def longest_token(tokenizer) -> int:
    """The most input characters one token can stand for: its length in the vocabulary. Byte-level BPE writes one
    character per byte (and a character is at least a byte), sentencepiece one per character ("▁" for a space,
    "<0x41>" for one byte), special tokens as themselves. So a text of N characters is >= N / this many tokens
    (not so for a tokenizer that fuses runs of unknown characters into one token; none that load.py reads)."""
    return max(map(len, tokenizer.backend.get_vocab(with_added_tokens=True)))


def check_chars(text: str, max_chars: int, param: str) -> None:
    """Refuse a text too long for the context by its length alone, before tokenizing it: megabytes of prompt are
    never tokenized. max_chars: (positions - 1) * longest_token(tokenizer)."""
    if len(text) > max_chars:
        raise BadRequest(f"the prompt is {len(text)} characters, longer than the context: no more than {max_chars} "
                         "characters can fit in it", param)


def completion_prompts(body: dict, tokenizer, max_chars: int,
                       special: bool = True) -> tuple[list[list[int]], list[str]]:
    """The prompts of /v1/completions and their texts: a string (encoded with BOS; special tokens' names in it are
    those tokens unless `special` is False, serve.py --prompt-special-tokens text), token ids, or an array of
    either (a batch: one choice, or n, per prompt)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or is_token_list(prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or len(prompt) > MAX_CHOICES:
        raise BadRequest(f"prompt must be a string, a non-empty array of token ids, or an array of up to "
                         f"{MAX_CHOICES} of these", "prompt")
    ids, texts = [], []
    for i, one in enumerate(prompt):
        if isinstance(one, str):
            check_chars(one, max_chars, "prompt")
            ids.append(tokenizer.encode(one, special=special))
            texts.append(one)
        elif is_token_list(one):
            bad = [t for t in one if not 0 <= t < tokenizer.vocab_size]
            if bad:
                raise BadRequest(f"prompt token id {bad[0]} is outside the vocabulary [0, {tokenizer.vocab_size})",
                                 "prompt")
            ids.append(one)
            texts.append(tokenizer.decode(one))
        else:
            raise BadRequest(f"prompt[{i}] must be a string or a non-empty array of token ids", "prompt")
    return ids, texts


def is_token_list(value) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def chat_prompt(body: dict, tokenizer, max_chars: int,
                tools: ToolRequest | None = None) -> tuple[list[int], str]:
    """The prompt of /v1/chat/completions and its text: the messages rendered with the model's chat template (which
    has BOS) and the request's chat_template_kwargs, their contents tokenized as text (a special token's name in a
    message is no special token, as in OpenAI's API). tools: the request's tools, rendered into the prompt
    (tools.py), and its tool call history checked."""
    import jinja2

    messages = get(body, "messages", "array")
    if not messages:
        raise BadRequest("messages must be a non-empty array", "messages")
    turns = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise BadRequest(f"messages[{i}] must be an object with role system, developer, user, assistant or "
                             f"tool, got {json.dumps(m)[:50]}", "messages")
        content = m.get("content")
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) for p in content):
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str) and not (content is None and m.get("tool_calls")):
            raise BadRequest(f"messages[{i}].content must be a string or an array of text parts", "messages")
        turn = {"role": "system" if role == "developer" else role, "content": content}
        turns.append({**turn, **{k: m[k] for k in ("tool_calls", "tool_call_id") if m.get(k) is not None}})
    try:
        turns, template_tools = (tools or tool_request(None, None, None, tokenizer)).render(turns)
    except ValueError as e:
        raise BadRequest(str(e), field_of(e) or "messages") from None
    variables = template_kwargs(body)
    try:
        text = tokenizer.apply_chat_template(turns, tools=template_tools, variables=variables)
        check_chars(text, max_chars, "messages")
        return tokenizer.encode_chat(turns, tools=template_tools, variables=variables), text
    except jinja2.TemplateError as e:
        raise BadRequest(f"the model's chat template rejected the messages: {e}", "messages") from None


def template_kwargs(body: dict) -> dict:
    """chat_template_kwargs: more variables for the chat template (Qwen3's enable_thinking), as vLLM takes them."""
    variables = get(body, "chat_template_kwargs", "object", {})
    taken = [k for k in variables if k in TEMPLATE_VARIABLES]
    if taken:
        raise BadRequest(f"chat_template_kwargs may not set {taken[0]}: the server renders it from the request",
                         "chat_template_kwargs")
    return variables


def tools_of(body: dict, tokenizer, parser: str | None) -> ToolRequest | None:
    """A chat request's tools, tool_choice and parallel_tool_calls, checked; None without tools."""
    if body.get("tools") is None and body.get("tool_choice") is None:
        return None
    try:
        return tool_request(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"), tokenizer,
                            parser=parser)
    except ValueError as e:
        raise BadRequest(str(e), field_of(e) or "tools") from None


def constraint_of(body: dict) -> tuple[Constraint, str] | None:
    """The structured output a request asks for, and the field that asks; None for plain text."""
    given = [name for name in GUIDED if body.get(name) is not None]
    if len(given) > 1:
        raise BadRequest(f"pass at most one of {', '.join(GUIDED)}; got {' and '.join(given)}", given[1])
    if not given:
        return None
    name = given[0]
    if name == "response_format":
        fmt = get(body, name, "object")
        kind = fmt.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return Constraint("json_object"), name
        if kind != "json_schema":
            raise BadRequest(f"response_format.type must be text, json_object or json_schema, got "
                             f"{json.dumps(kind)[:50]}", name)
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise BadRequest("response_format.json_schema must be an object with the schema in its schema field "
                             '({"name": ..., "schema": {...}, "strict": true})', name)
        return Constraint("json_schema", json.dumps(spec["schema"])), name
    if name == "guided_json":  # a schema, or a schema's JSON text
        schema = body[name]
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise BadRequest(f"guided_json is not valid JSON: {e}", name) from None
        if not isinstance(schema, dict):
            raise BadRequest("guided_json must be a JSON schema (an object)", name)
        return Constraint("json_schema", json.dumps(schema)), name
    if name == "guided_choice":  # exactly one of the strings
        choices = get(body, name, "array")
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise BadRequest("guided_choice must be a non-empty array of non-empty strings", name)
        # One terminal of alternatives, lexed as one regex: as alternatives of a rule, llguidance's parser holds
        # an item per choice in a row and refuses rows of over 2,000.
        return Constraint("grammar", "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in choices)), name
    return Constraint("regex" if name == "guided_regex" else "grammar", get(body, name, "string")), name


@dataclass
class Call:
    """One API call, parsed: the engine requests to submit (one per prompt, each with its n choices) and how to
    answer them."""
    chat: bool
    requests: list[Request]
    texts: list[str]  # each prompt's text (completions' echo puts it before the completion)
    stream: bool = False
    include_usage: bool = False  # stream_options: usage in a last chunk
    continuous_usage: bool = False  # stream_options (vLLM): usage so far in every chunk
    n: int = 1  # choices per prompt: choice index = prompt index * n + the engine's choice index
    logprobs: int | None = None  # alternatives per token in the answer; None: no logprobs
    echo: bool = False
    ignored: tuple[str, ...] = ()  # unknown fields, ignored (the server logs them)
    model: str | None = None  # the model name asked for (any served name is served by the one model)
    tools: ToolRequest | None = None  # chat's tools: calls are parsed out of each choice's text
    reasoning: Tags | None = None  # chat: the reasoning block's tags, split out of each choice's text
    thinking: bool = False  # the prompt leaves the model inside its reasoning block (DeepSeek-R1's template)
    context: dict = field(default_factory=dict)  # what an API's answer needs of its request (Responses: its
    # settings to echo, the conversation to store)


def parse_request(body, chat: bool, tokenizer, *, max_len: int, max_chars: int,
                  compile_grammar: Callable[[Constraint], Grammar] | None = None, special: bool = True,
                  tool_parser: str | None = None, reasoning: Tags | None = None,
                  sampling_defaults: dict | None = None) -> Call:
    """A request body -> Call; BadRequest names what is wrong. max_len: the most positions a sequence may take,
    prompt and completion (chat's max_tokens defaults to what the prompt leaves of it); max_chars: the longest
    prompt text worth tokenizing (see check_chars); compile_grammar: a structured-output constraint -> its
    compiled grammar (ValueError for a bad one); special: whether special tokens' names in a completion prompt
    are those tokens (see completion_prompts); tool_parser: the tool call syntax (toolcalls.FORMATS) when not the
    chat template's; reasoning: the tags of the model's reasoning block, to split it out of chat answers;
    sampling_defaults: the sampling fields' values when left out (sampling_params' preset)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for name in (*NOT_SERVED, *([] if chat else ["tools", "tool_choice"])):
        if body.get(name) is not None:
            raise BadRequest(f"{name} is not served on {'this endpoint' if name.startswith('tool') else 'this server'}"
                             f" ({'/v1/chat/completions serves' if name.startswith('tool') else 'use'} tools)", name)
    model = get(body, "model", "string")
    get(body, "user", "string")
    tools = tools_of(body, tokenizer, tool_parser) if chat else None
    fim_stops = []  # with a suffix, the FIM tokens end the middle
    rendered = ""
    if chat:
        prompt, rendered = chat_prompt(body, tokenizer, max_chars, tools)
        prompts, texts = [prompt], [""]
    elif get(body, "suffix", "string"):  # "" asks for no suffix (some clients send it)
        prompts, texts, fim_stops = fim_prompts(body, tokenizer, max_chars)
    else:
        prompts, texts = completion_prompts(body, tokenizer, max_chars, special)
    call = Call(chat, [], texts, ignored=tuple(sorted(set(body) - (CHAT_FIELDS if chat else COMPLETION_FIELDS))),
                tools=tools, model=model, reasoning=reasoning if chat else None)
    call.thinking = call.reasoning is not None and opens_thinking(rendered, call.reasoning)
    call.echo = not chat and get(body, "echo", "boolean", False)
    call.logprobs = logprobs_of(body, chat)
    call.stream, call.include_usage, call.continuous_usage = stream_of(body)
    call.n = get(body, "n", "integer", 1)
    best_of = get(body, "best_of", "integer", call.n) if not chat else call.n
    if not 1 <= call.n <= best_of or len(prompts) * best_of > MAX_CHOICES:
        name = "n" if call.n < 1 or chat or best_of == call.n else "best_of"
        raise BadRequest(f"need 1 <= n <= best_of and prompts x best_of <= {MAX_CHOICES}; got n={call.n}, "
                         f"best_of={best_of} and {len(prompts)} prompts", name)
    if call.stream and best_of > call.n:
        raise BadRequest("best_of > n cannot stream: the best are known only at the end", "best_of")
    params = sampling_params(body, tokenizer.vocab_size, sampling_defaults)
    stop = stop_of(body, fim_stops)
    seed = get(body, "seed", "integer")
    if seed is not None and not 0 <= seed < 2 ** 64:
        raise BadRequest(f"seed must be in [0, 2**64), got {seed}", "seed")
    grammar = grammar_of(body, compile_grammar, tools)
    for prompt in prompts:
        max_tokens = max_tokens_of(body, chat, len(prompt), max_len, call.echo)
        # echo's prompt logprobs when asked; echo of max_tokens 0 alone runs the prefill only, which asks for them
        echo_logprobs = None if not call.echo else call.logprobs if call.logprobs is not None or max_tokens else 0
        call.requests.append(Request(prompt, params, max_tokens, stop, seed, grammar=grammar, n=call.n,
                                     best_of=best_of, logprobs=call.logprobs, prompt_logprobs=echo_logprobs))
    return call


def parse_capped(chat: dict, name: str, tokenizer, **limits) -> Call:
    """parse_request of a chat body whose max_tokens is a cap, not a demand (Anthropic's max_tokens, Responses'
    max_output_tokens; `name` is the field): cut to what the prompt leaves of the context rather than refused, as
    agents ask for more than a small local model holds (Claude Code: 64,000)."""
    cap = get(chat, "max_tokens", "integer")
    if cap is not None and cap < 1:
        raise BadRequest(f"{name} must be >= 1, got {cap}", name)
    try:
        call = parse_request({k: v for k, v in chat.items() if k != "max_tokens"}, True, tokenizer, **limits)
    except RecursionError:  # json.dumps quoting a value in a message
        raise BadRequest("the request body is nested too deeply") from None
    for request in call.requests:
        request.max_new_tokens = min(request.max_new_tokens, cap or request.max_new_tokens)
    return call


def fim_tokens_of(tokenizer, param: str) -> FimTokens:
    """The model's fill-in-the-middle tokens; BadRequest naming `param` for a model without them."""
    try:
        return find_fim_tokens(tokenizer)
    except ValueError as e:
        raise BadRequest(f"{param} asks for fill-in-the-middle, but {e}", param) from None


def fim_prompts(body: dict, tokenizer, max_chars: int) -> tuple[list[list[int]], list[str], list[str]]:
    """/v1/completions with a suffix: each prompt (text) is the prefix of a fill-in-the-middle prompt (PSM, as
    llama.cpp's /infill builds it), and the completion is the middle. (prompts' ids, their texts, the FIM tokens'
    names, which end a middle)."""
    suffix = body["suffix"]
    fim = fim_tokens_of(tokenizer, "suffix")
    if get(body, "echo", "boolean", False):
        raise BadRequest("echo cannot be combined with suffix", "echo")
    prompt = body.get("prompt")
    prompt = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompt, list) or not prompt or len(prompt) > MAX_CHOICES or \
            not all(isinstance(p, str) for p in prompt):
        raise BadRequest(f"with a suffix, prompt must be a string or an array of up to {MAX_CHOICES} strings (the "
                         "text before the gap)", "prompt")
    for one in prompt:
        check_chars(one + suffix, max_chars, "prompt")
    return [infill_prompt(tokenizer, fim, one, suffix) for one in prompt], list(prompt), fim.stops(tokenizer)


def parse_json(raw: bytes):
    """A request body's JSON; BadRequest for what is not JSON, or is nested too deeply, or holds no text."""
    try:
        try:
            body = json.loads(raw)
        except ValueError as e:  # also bad UTF-8
            raise BadRequest(f"the request body is not valid JSON: {e}") from None
        check_unicode(body)
        return body
    except RecursionError:  # json.loads
        raise BadRequest("the request body is nested too deeply") from None


def parse_body(raw: bytes, chat: bool, tokenizer, **limits) -> Call:
    """parse_request of a raw body (limits: parse_request's keyword arguments). Run on a worker thread: a large
    body takes a while to parse and tokenize, and a grammar to compile."""
    body = parse_json(raw)
    try:
        return parse_request(body, chat, tokenizer, **limits)
    except RecursionError:  # json.dumps quoting a value in a message
        raise BadRequest("the request body is nested too deeply") from None


def parse_tokenize(body, tokenizer, max_chars: int) -> list[int]:
    """POST /tokenize: vLLM's {"prompt": text, "add_special_tokens": true} or {"messages": [...]}, or llama.cpp's
    {"content": text, "add_special": false} -> ids. add_special(_tokens): the tokenizer's BOS first (special tokens'
    names are those tokens either way, as in a completions prompt); messages are rendered with the chat template,
    as a chat request's prompt."""
    given = [name for name in ("prompt", "messages", "content") if name in body] if isinstance(body, dict) else []
    if len(given) != 1:
        raise BadRequest("the request must be an object with one of prompt (a string), messages (an array) or "
                         "content (a string)")
    if given[0] == "messages":
        return chat_prompt(body, tokenizer, max_chars)[0]
    text = get(body, given[0], "string")
    if text is None:
        raise BadRequest(f"{given[0]} must be a string", given[0])
    check_chars(text, max_chars, given[0])
    if given[0] == "prompt":
        bos = get(body, "add_special_tokens", "boolean", True)
    else:  # llama.cpp's default: no BOS
        bos = get(body, "add_special", "boolean", False)
    return tokenizer.encode(text, bos=None if bos else False)


def tokenize_answer(body: dict, ids: list[int], tokenizer, max_len: int) -> dict:
    """/tokenize's answer: vLLM's {count, max_model_len, tokens, token_strs} (token_strs: the vocabulary's
    strings with return_token_strs); llama.cpp's with_pieces makes each token {id, piece}, the piece its text (or
    its bytes, for part of a character)."""
    strs = [tokenizer.backend.id_to_token(i) for i in ids] if get(body, "return_token_strs", "boolean") else None
    tokens = ids
    if get(body, "with_pieces", "boolean", False):
        tokens = []
        for i in ids:
            raw = tokenizer.token_bytes(i)
            try:
                tokens.append({"id": i, "piece": raw.decode("utf-8")})
            except UnicodeDecodeError:
                tokens.append({"id": i, "piece": list(raw)})
    return {"count": len(ids), "max_model_len": max_len, "tokens": tokens, "token_strs": strs}


def parse_detokenize(body, tokenizer) -> str:
    """POST /detokenize (vLLM's shape): {"tokens": [ids]} -> their text."""
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise BadRequest("tokens must be an array of token ids", "tokens")
    bad = [t for t in tokens if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise BadRequest(f"token id {bad[0]} is outside the vocabulary [0, {tokenizer.vocab_size})", "tokens")
    return tokenizer.decode(tokens)


def logprobs_of(body: dict, chat: bool) -> int | None:
    """How many alternatives per token a call asks for, None for no logprobs: chat's logprobs (boolean) with
    top_logprobs (0-20), completions' logprobs (an integer, 0-20)."""
    if chat:
        top = get(body, "top_logprobs", "integer")
        if not get(body, "logprobs", "boolean", False):
            if top:
                raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
            return None
        name, n = "top_logprobs", top or 0
    else:
        name, n = "logprobs", get(body, "logprobs", "integer")
        if n is None:
            return None
    if not 0 <= n <= MAX_LOGPROBS:
        raise BadRequest(f"{name} must be in [0, {MAX_LOGPROBS}], got {n}", name)
    return n


def stream_of(body: dict) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage_stats); other stream_options are ignored, as other fields are."""
    stream = get(body, "stream", "boolean", False)
    options = get(body, "stream_options", "object", {})
    if options and not stream:
        raise BadRequest("stream_options is only allowed with stream: true", "stream_options")
    return (stream, get(options, "include_usage", "boolean", False),
            get(options, "continuous_usage_stats", "boolean", False))


def max_tokens_of(body: dict, chat: bool, prompt_tokens: int, max_len: int, echo: bool) -> int:
    """The tokens a prompt may generate: max_tokens (chat: or max_completion_tokens), 0 only with echo (the prompt
    alone, with its logprobs when asked: lm-eval's loglikelihood)."""
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    asked = get(body, name, "integer")
    if asked is not None and asked < (0 if echo else 1):
        raise BadRequest(f"{name} must be >= {0 if echo else 1}, got {asked}", name)
    if asked == 0:
        return 0
    try:  # as OpenAI and vLLM: a 400, not a completion silently cut at the context
        return fit_new_tokens(asked, None if chat else COMPLETION_MAX_TOKENS, prompt_tokens, max_len, name,
                              "the context")
    except ValueError as e:
        raise BadRequest(str(e), name) from None


def stop_of(body: dict, more: list[str] = ()) -> list[str]:
    """The request's stop strings, and `more` of the server's own (fill-in-the-middle's) not already among them."""
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a non-empty string or an array of non-empty strings", "stop")
    stop = [*stop, *(s for s in more if s not in stop)]
    try:
        check_stop(stop)  # their number and length: the engine thread scans for them at every token
    except ValueError as e:
        raise BadRequest(str(e), "stop") from None
    return stop


def grammar_of(body: dict, compile_grammar: Callable[[Constraint], Grammar] | None,
               tools: ToolRequest | None = None) -> Grammar | None:
    """The compiled grammar of the structured output asked for, of the tool calls, or of both (one per request):
    with tools, a response format applies to the text answer (ToolRequest.constraint_with)."""
    asked = constraint_of(body)
    if tools is not None and tools.tools:
        param = "tools" if asked is None else asked[1]  # the tools were checked alone in tool_request
        try:
            if asked is not None:
                check_constraint(asked[0])  # the format's own errors, as without tools
            asked = tools.constraint_with(None if asked is None else asked[0]), param
        except ValueError as e:
            raise BadRequest(str(e), param) from None
    if asked is None:
        return None
    if compile_grammar is None:
        raise BadRequest("structured output is not served here", asked[1])
    try:
        grammar = compile_grammar(asked[0])
    except ValueError as e:
        raise BadRequest(str(e), asked[1]) from None
    return grammar if tools is None else tools.grammar(grammar)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """An error in OpenAI's format."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}

