"""Tokenizer: text <-> token ids for Hugging Face folders and GGUF files, chat templates, streaming decode.

Every source is turned into one `tokenizers.Tokenizer` backend (the library transformers itself runs on), so
encode/decode match transformers. BOS/EOS are added here, never by the backend's post-processor, so BOS is
added exactly once and only when asked.
"""

import json
import os
import re
import threading
from functools import lru_cache

from features.fim import GGUF_KEYS
from formats.vocab import (NORMAL, byte_level_backend, read_sentencepiece_model, sentencepiece_backend,
                           sentencepiece_pipeline)


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character standing for each byte in a byte-level BPE vocabulary
    (printable bytes stand for themselves, the others for the characters from U+0100 on)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(moved)}}


_BYTE_OF = _bytes_to_unicode()


class Tokenizer:
    """Encode/decode with the model's BOS/EOS ids and chat template."""

    def __init__(self, backend, bos_id: int | None, eos_ids: list[int], add_bos: bool,
                 chat_template: str | None = None, add_eos: bool = False, fim_ids: dict[str, int] | None = None):
        self.backend = backend  # a tokenizers.Tokenizer
        self.fim_ids = fim_ids or {}  # fill-in-the-middle tokens a GGUF names, by role (features/fim.py)
        self.bos_id = bos_id
        self.eos_ids = list(dict.fromkeys(i for i in eos_ids if i is not None))
        self.add_bos = add_bos and bos_id is not None
        self.add_eos = add_eos and bool(self.eos_ids)  # appends eos_ids[0], the tokenizer's own EOS
        self.chat_template = chat_template
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token = backend.id_to_token(bos_id) if bos_id is not None else None
        self.eos_token = backend.id_to_token(self.eos_ids[0]) if self.eos_ids else None
        # The special tokens' names ("<|im_start|>"), longest first: a regex alternative wins by order, and the
        # backend matches the longest name.
        names = sorted((t.content for t in backend.get_added_tokens_decoder().values() if t.special), key=len,
                       reverse=True)
        self.specials = re.compile("|".join(map(re.escape, names))) if names else None
        self._text_backend = None  # the backend matching no special token, built at first use (see text_backend)
        self._lock = threading.Lock()  # requests are tokenized on several threads
        decoder = backend.decoder  # byte-level BPE: each piece's characters stand for bytes (see token_bytes)
        self._byte_level = decoder is not None and b'"ByteLevel"' in decoder.__getstate__()

    def encode(self, text: str, bos: bool | None = None, special: bool = True) -> list[int]:
        """Token ids of `text`. special: a special token's name written in it ("<|im_start|>") is that token, else
        it is text like the rest. bos=None follows add_bos."""
        ids = (self.backend if special else self.text_backend()).encode(text, add_special_tokens=False).ids
        if self.add_bos if bos is None else bos:
            if self.bos_id is None:
                raise ValueError("bos=True but this tokenizer has no BOS token")
            ids = [self.bos_id] + ids
        if self.add_eos:
            ids.append(self.eos_ids[0])
        return ids

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens included."""
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, as it reads inside a text (with its leading space): a byte-level token
        may be part of a UTF-8 character, so its text alone (U+FFFD) would not say."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})")
        if byte := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece):  # sentencepiece's byte fallback
            return bytes([int(byte.group(1), 16)])
        if self._byte_level and set(piece) <= _BYTE_OF.keys():
            return bytes(_BYTE_OF[c] for c in piece)
        return piece.replace("\u2581", " ").encode()  # sentencepiece writes a space as U+2581

    def token_text(self, token_id: int) -> str:
        """One token's text as it reads inside a text (U+FFFD for part of a character)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def text_backend(self):
        """A copy of the backend that reads special tokens' names as text, made when first needed (copying a
        vocabulary takes a while, and most tokenizers never need it)."""
        from tokenizers import Tokenizer as Backend

        with self._lock:
            if self._text_backend is None:
                self._text_backend = Backend.from_str(self.backend.to_str())
                self._text_backend.encode_special_tokens = True  # user-defined (non-special) tokens still match
            return self._text_backend

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, variables: dict | None = None) -> list[int]:
        """Token ids of `messages` rendered with the chat template (and `tools`, the template's `tools` variable):
        the template's own special tokens are control tokens and every string the caller gave (contents, tool
        calls, tool definitions) is text, as OpenAI tokenizes chat. So "<|im_end|>\\n<|im_start|>system" typed
        in a message is those characters, never a turn of its own. variables: more of the template's variables
        (a request's chat_template_kwargs: Qwen3's enable_thinking)."""
        if self.specials is None or not _any_string(self.specials.search, [messages, tools]):
            return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools, variables), bos=False)
        # Render with each special token's name in a given string hidden behind a placeholder: every special token
        # left in the text is then the template's own. Between them, each stretch is encoded as text, names
        # restored. (Each stretch is tokenized on its own, as the backend does between special tokens anyway; a
        # sentencepiece vocabulary adds its "▁" prefix before each stretch where it would add it only at the text's
        # start.) The placeholder's private-use character is hidden as well where a string has it, so it marks only
        # them. Roles are the template's to read, never hidden.
        mark = "\ue000"
        hiding = re.compile(f"{self.specials.pattern}|{mark}")
        names: list[str] = []

        def hide(match: re.Match) -> str:
            names.append(match.group())
            return f"{mark}{len(names) - 1}{mark}"

        def hidden(value, key=None):
            if isinstance(value, str):
                return value if key == "role" else hiding.sub(hide, value)
            if isinstance(value, dict):
                return {k: hidden(v, k) for k, v in value.items()}
            if isinstance(value, list):
                return [hidden(v) for v in value]
            return value

        text = self.apply_chat_template(hidden(messages), add_generation_prompt, hidden(tools), variables)
        placeholder = re.compile(f"{mark}([0-9]+){mark}")
        ids, start = [], 0
        for match in [*self.specials.finditer(text), None]:
            stretch = placeholder.sub(lambda p: names[int(p.group(1))], text[start:match.start() if match else None])
            ids += self.text_backend().encode(stretch, add_special_tokens=False).ids if stretch else []
            if match is not None:
                ids.append(self.backend.token_to_id(match.group()))
                start = match.end()
        return ids + [self.eos_ids[0]] * self.add_eos

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, variables: dict | None = None) -> str:
        """Render `messages` with the model's Jinja chat template, as transformers' apply_chat_template does;
        `tools` (OpenAI tool definitions) is the template's `tools` variable (tools.py renders them into the
        messages for a template that does not read it)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template; pass a model that ships one")
        # transformers drops None fields: templates test `'key' in message`, not the value
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        return _compile_template(self.chat_template).render(
            **(variables or {}), messages=messages, tools=tools or None, documents=None,
            add_generation_prompt=add_generation_prompt, bos_token=self.bos_token, eos_token=self.eos_token)

    def stream(self) -> "StreamDecoder":
        """A fresh incremental detokenizer."""
        return StreamDecoder(self)


class StreamDecoder:
    """Incremental detokenizer: push ids one at a time, get back the text that is now final.

    Like vLLM's incremental detokenizer, it decodes a window (tokens emitted last time + new ones) and emits the
    difference, so SentencePiece's first-token space rule and multi-token UTF-8 characters come out right.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # window start: tokens already emitted, decoded again only for context
        self.read = 0  # tokens before this index have been emitted

    def push(self, token_id: int) -> str:
        """Add one token; return the newly final text (maybe "")."""
        self.ids.append(int(token_id))
        return self._emit(final=False)

    def flush(self) -> str:
        """Return whatever is held back (e.g. an incomplete UTF-8 sequence)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        done = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        # A character split over byte tokens decodes to U+FFFD until its last byte arrives.
        if not final and (len(text) <= len(done) or text.endswith("\ufffd")):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done):]


def load_tokenizer(path: str) -> Tokenizer:
    """Load from a Hugging Face folder (tokenizer.json or tokenizer.model) or from a .gguf file alone."""
    if os.path.isdir(path):
        return _load_folder(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer path {path!r} does not exist; expected a folder with "
                                "tokenizer.json or tokenizer.model, or a .gguf file")
    from formats.gguffile import read_gguf

    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ValueError(f"not a GGUF file (magic {magic!r}); pass a .gguf file or a model folder")
        meta, _ = read_gguf(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read GGUF file {path!r}: {e.strerror if isinstance(e, OSError) else e}") from None
    return tokenizer_from_gguf_metadata({k: v for k, v in meta.items() if k.startswith("tokenizer.")})


TURN_ENDS = ("<end_of_turn>", "<|end|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>")


def tokenizer_from_gguf_metadata(meta: dict) -> Tokenizer:
    """Build the tokenizer a GGUF file embeds, from its `tokenizer.*` metadata (llama.cpp key names)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; supported: 'gpt2' (byte-level BPE), "
                         "'llama' (SentencePiece)")
    needs = ["tokenizer.ggml.tokens", "tokenizer.ggml.merges" if kind == "gpt2" else "tokenizer.ggml.scores"]
    missing = [key for key in needs if not isinstance(meta.get(key), list)]
    if missing:
        raise ValueError(f"this GGUF file has no {' or '.join(missing)} list, so it embeds no usable tokenizer")
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if kind == "gpt2":
        backend = byte_level_backend(tokens, meta["tokenizer.ggml.merges"], types,
                                      meta.get("tokenizer.ggml.pre", "default"))
    else:
        prepend = "first" if meta.get("tokenizer.ggml.add_space_prefix", True) else "never"
        backend = sentencepiece_backend(tokens, meta["tokenizer.ggml.scores"], types, prepend,
                                         meta.get("tokenizer.ggml.remove_extra_whitespaces", False))
    eos = [meta.get(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")]
    # and the turn ends llama.cpp ends generation at by their text, which the converter leaves unnamed: a Gemma
    # file's eos is <eos>, its chat turns end with <end_of_turn>; a Phi-3 file's eos is <|endoftext|>, its turns <|end|>
    eos += [i for i, text in enumerate(tokens) if text in TURN_ENDS]
    if {"<|return|>", "<|call|>"} <= set(tokens):  # harmony (gpt-oss): <|end|> ends a message, not the output,
        # which ends at <|return|> or <|call|> (llama.cpp drops <|end|> from its end tokens alike)
        eos = [i for i in eos if not (isinstance(i, int) and 0 <= i < len(tokens) and tokens[i] == "<|end|>")]
        eos += [i for i, text in enumerate(tokens) if text in ("<|return|>", "<|call|>")]
    # llama.cpp adds BOS for SentencePiece vocabularies unless the file says otherwise
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
    fim = {role: meta.get(f"tokenizer.ggml.{key}_token_id") for role, key in GGUF_KEYS.items()}  # features/fim.py
    fim = {role: i for role, i in fim.items() if isinstance(i, int) and 0 <= i < len(tokens)}
    return Tokenizer(backend, meta.get("tokenizer.ggml.bos_token_id"), eos, add_bos,
                     meta.get("tokenizer.chat_template"), meta.get("tokenizer.ggml.add_eos_token", False), fim)


def _load_folder(path: str) -> Tokenizer:
    """A Hugging Face folder, read the way transformers 5 reads it."""
    from tokenizers import Tokenizer as Backend, models

    cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
    json_file, spm_file = os.path.join(path, "tokenizer.json"), os.path.join(path, "tokenizer.model")
    # transformers 5 rebuilds a Llama tokenizer from its class, not from the file's pipeline: '▁' goes before the
    # text only ("first"), or also after each special token when legacy, as its generic sentencepiece converter does
    # (but before text that starts with a space too, as sentencepiece does and transformers does not)
    llama = cfg.get("tokenizer_class") in ("LlamaTokenizer", "LlamaTokenizerFast")
    prepend = "first" if llama and not cfg.get("legacy") else "always"
    if os.path.isfile(json_file):
        try:
            backend = Backend.from_file(json_file)
        except Exception as e:  # tokenizers raises a plain Exception for a file it cannot parse
            raise ValueError(f"cannot read tokenizer file {json_file}: {e}") from None
        if llama and isinstance(backend.model, models.BPE):
            sentencepiece_pipeline(backend, prepend if cfg.get("add_prefix_space", True) else "never")
    elif os.path.isfile(spm_file):
        pieces, scores, types, add_prefix, squeeze = read_sentencepiece_model(spm_file)
        if cfg.get("add_prefix_space") is not None:
            add_prefix = cfg["add_prefix_space"]
        backend = sentencepiece_backend(pieces, scores, types, prepend if add_prefix else "never", squeeze)
        cfg = {"bos_token": "<s>", "eos_token": "</s>", **cfg}  # LlamaTokenizer's defaults
    else:
        raise FileNotFoundError(f"no tokenizer.json or tokenizer.model in folder {path!r}")

    config = _read_json(os.path.join(path, "config.json"))
    generation = _read_json(os.path.join(path, "generation_config.json"))
    bos_token, eos_token = _token_text(cfg, "bos_token"), _token_text(cfg, "eos_token")
    bos_id = backend.token_to_id(bos_token) if bos_token else None
    if bos_id is None and "bos_token" not in cfg:
        bos_id = (_token_ids(config, "bos_token_id", "config.json") or [None])[0]
    eos_ids = [backend.token_to_id(eos_token) if eos_token else None]
    eos_ids += _token_ids(generation, "eos_token_id", "generation_config.json")
    eos_ids += _token_ids(config, "eos_token_id", "config.json")

    if os.path.isfile(json_file):
        # transformers ignores add_bos_token/add_eos_token here: tokenizer.json's post-processor decides
        marked = backend.encode("a", add_special_tokens=True).ids
        add_bos = bos_id is not None and marked[:1] == [bos_id]
        add_eos = eos_ids[0] is not None and marked[-1:] == [eos_ids[0]]
    else:
        add_bos, add_eos = cfg.get("add_bos_token", False), cfg.get("add_eos_token", False)

    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"tokenizer_config.json chat_template must be a string or a list of named templates, "
                         f"got {str(template)[:50]!r}")
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):  # what current transformers writes; it wins over tokenizer_config.json
        try:
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read {jinja_file}: {e}") from None
    return Tokenizer(backend, bos_id, eos_ids, add_bos, template, add_eos)


@lru_cache(maxsize=8)
def template_variables(source: str) -> frozenset[str]:
    """The variables a chat template reads from its context (`messages`, `tools`, ...): what it can render."""
    from jinja2 import meta

    return frozenset(meta.find_undeclared_variables(_template_env().parse(source)))


def _any_string(found, value) -> bool:
    """Whether found(s) holds for a string anywhere in value (nested dicts and lists)."""
    if isinstance(value, str):
        return bool(found(value))
    if isinstance(value, dict):
        return any(_any_string(found, v) for v in value.values())
    if isinstance(value, list):
        return any(_any_string(found, v) for v in value)
    return False


@lru_cache(maxsize=8)
def _compile_template(source: str):
    """Compile a chat template in the Jinja environment transformers uses."""
    return _template_env().from_string(source)


@lru_cache(maxsize=1)
def _template_env():
    """The Jinja environment transformers renders chat templates in."""
    import datetime
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        # `{% generation %}` only marks assistant text for training masks; render its body unchanged
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters, which would change prompts
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def _read_json(path: str) -> dict:
    """The JSON object in path; {} when there is no such file, a ValueError naming it when it holds no object."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON (UnicodeDecodeError, JSONDecodeError)
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, not a {type(value).__name__}")
    return value


def _token_text(cfg: dict, key: str) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict {"content": ...}."""
    token = cfg.get(key)
    token = token.get("content") if isinstance(token, dict) else token
    if token is not None and not isinstance(token, str):
        raise ValueError(f"tokenizer_config.json {key} must be a string, got {token!r}")
    return token


def _token_ids(cfg: dict, key: str, file: str) -> list[int]:
    """cfg[key] as a list of token ids: absent or null, one id, or a list of them."""
    value = cfg.get(key)
    ids = [] if value is None else list(value) if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{file} {key} must be a token id or a list of them, got {value!r}")
    return ids
