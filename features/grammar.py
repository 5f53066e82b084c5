"""Constrained decoding (structured output): JSON Schema, any JSON object, a regex or a grammar, with llguidance.

A Compiler turns the tokenizer's vocabulary into llguidance's token table once (each id's bytes, its EOS ids) and
compiles constraints against it, keeping the compiled grammars by (kind, spec). Each generated sequence gets its own
Matcher; before every sample, mask_logits sets the logits of the tokens its grammar forbids to -inf, so temperature,
top-k/top-p/min-p and the reported logprobs act on the allowed tokens only. EOS is allowed only where the grammar
may end; once nothing but EOS could follow, the sequence ends (end reason "stop").

What a constraint is, the compiled Grammar and a sequence's Matcher are constraint.py's (torch-free: the request
parser imports them); here are the vocabulary, the compiler and the masks over the logits.

Shape legend: B rows, V vocab (the model's logits, which may be wider than the tokenizer), W = ceil(V / 32) words.
"""
import re
from collections import OrderedDict

import torch

from features.constraint import Constraint, Grammar, Matcher, limits, matcher_error, one_line, to_llguidance

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece byte fallback


def token_bytes(tokenizer, vocab_size: int) -> tuple[list[bytes], list[int]]:
    """(the bytes each token id stands for, the special ids), for ids 0..vocab_size-1. Byte-level BPE (GPT-2 style:
    each byte written as one printable character) and sentencepiece (a space as '▁', <0xNN> byte tokens) are read.
    A special token is 0xFF and its name, llguidance's mark for one (its llama.cpp binding writes them so): no text
    matches it, and a Lark grammar can name it (`<[id]>`, as tools.py's triggers); ids past the tokenizer's
    vocabulary have no bytes. Either way no grammar allows them as text."""
    backend = tokenizer.backend
    decoder = repr(backend.decoder)
    added = backend.get_added_tokens_decoder()  # id -> AddedToken
    if decoder.startswith("ByteLevel"):
        to_byte = byte_level_table()
        decode = lambda piece: bytes(to_byte[c] for c in piece)  # noqa: E731
    elif "ByteFallback" in decoder or "Metaspace" in decoder:
        def decode(piece: str) -> bytes:
            m = _BYTE_TOKEN.fullmatch(piece)
            return bytes([int(m.group(1), 16)]) if m else piece.replace("▁", " ").encode("utf-8")
    else:
        raise ValueError(f"constrained decoding supports byte-level BPE and sentencepiece vocabularies; this "
                         f"tokenizer's decoder is {decoder[:60]}")
    out, special = [], []
    for i in range(vocab_size):
        piece = backend.id_to_token(i) if i < tokenizer.vocab_size else None
        if piece is None or (i in added and added[i].special):
            out.append(b"" if piece is None else b"\xff" + piece.encode("utf-8"))
            special.append(i)
        elif i in added:
            out.append(added[i].content.encode("utf-8"))  # added tokens are written as plain text
        else:
            out.append(decode(piece))
    return out, special


def byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


class Compiler:
    """Compiles constraints against one tokenizer's vocabulary (read once) and keeps the last `cache_size`
    compiled grammars by (kind, spec). vocab_size: the width of the model's logits."""

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = 64):
        import llguidance

        if not tokenizer.eos_ids:
            raise ValueError("constrained decoding needs a tokenizer with an EOS token (to end where the grammar "
                             "ends)")
        tokens, special = token_bytes(tokenizer, vocab_size)
        self.vocab_size, self.cache_size = vocab_size, cache_size
        self.token_lengths = [len(t) for t in tokens]
        self.tokens = llguidance.LLTokenizer(Vocabulary(tokenizer, tokens, special), n_vocab=vocab_size,
                                             eos_token=tokenizer.eos_ids)
        # least recently used first; a spec that failed keeps its error, so sending it again costs nothing
        self.cache: OrderedDict[Constraint, Grammar | ValueError] = OrderedDict()

    def compile(self, constraint: Constraint) -> Grammar:
        """The compiled grammar (from the cache when it is there); ValueError for a bad schema, regex or grammar,
        including one that compiles but cannot be followed (see first_steps)."""
        grammar = self.cache.get(constraint)
        if grammar is None:
            try:
                grammar = Grammar(constraint, self.first_steps(constraint))
            except ValueError as e:
                grammar = e
            self.cache[constraint] = grammar
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        self.cache.move_to_end(constraint)
        if isinstance(grammar, ValueError):
            raise grammar
        return grammar

    def first_steps(self, constraint: Constraint):
        """A fresh llguidance.LLMatcher for the constraint, once its first mask, and the step after it along the
        longest allowed token, came out without an error. llguidance accepts some specs that fail only at a mask
        or a token (no text matches them; a limit is hit: a row of over 2,000 alternatives, a regex too large to
        lex): here they are a ValueError before any request is queued, not a failure mid-generation."""
        from llguidance import LLMatcher

        name = constraint.kind.replace("_", " ")
        template = LLMatcher(self.tokens, to_llguidance(constraint), log_level=0, limits=limits())
        if template.is_error():
            raise ValueError(f"invalid {name}: {matcher_error(template)}")
        probe, mask = template.deep_copy(), torch.zeros((1, (self.vocab_size + 31) // 32), dtype=torch.int32)
        probe.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * mask.element_size())  # (1, W)
        if one_line(probe.get_error()) == "NoExtensionBias":  # no first token, not even EOS
            raise ValueError(f"invalid {name}: no text matches it, so nothing can be generated")
        if not probe.is_error():
            allowed = unpack(mask, self.vocab_size)[0].nonzero().flatten().tolist()
            longest = max(allowed, key=self.token_lengths.__getitem__, default=None)
            if longest is not None and self.token_lengths[longest] and probe.consume_token(longest):  # not EOS
                probe.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * mask.element_size())
        if probe.is_error():
            raise ValueError(f"invalid {name}: {matcher_error(probe)}")
        return template


class Vocabulary:
    """What llguidance.LLTokenizer reads from a Python tokenizer (its TokenizerWrapper interface): each id's bytes,
    the special ids, and an encode function (for the text llguidance tokenizes itself)."""

    def __init__(self, tokenizer, tokens: list[bytes], special: list[int]):
        self.tokenizer = tokenizer
        self.tokens, self.special_token_ids = tokens, special
        self.eos_token_id, self.bos_token_id = tokenizer.eos_ids[0], tokenizer.bos_id
        self.is_tokenizer_wrapper = True

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self.tokenizer.encode(text, bos=False)


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, W) int32 bitmask -> (B, V) bool, True where the bit of that id is set."""
    bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1  # (B, W, 32)
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()  # (B, V)


def allowed(matcher: Matcher, vocab_size: int) -> torch.Tensor:
    """(V,) bool: the tokens matcher's grammar allows next."""
    bitmask = torch.zeros((1, (vocab_size + 31) // 32), dtype=torch.int32)  # (1, W)
    matcher.fill(bitmask[0])
    return unpack(bitmask, vocab_size)[0]


def mask_logits(logits: torch.Tensor, matchers: list[Matcher | None]) -> torch.Tensor:
    """(B, V) logits -> (B, V) logits with -inf for every token a row's grammar forbids; a row whose matcher is
    None is left as it is. The allowed logits are unchanged."""
    B, V = logits.shape
    bitmask = torch.full((B, (V + 31) // 32), -1, dtype=torch.int32)  # (B, W) all allowed
    for b, matcher in enumerate(matchers):
        if matcher is not None:
            matcher.fill(bitmask[b])
    allowed = unpack(bitmask, V).to(logits.device, non_blocking=True)  # (B, V)
    return logits.masked_fill(~allowed, float("-inf"))


def advance(matchers: list[Matcher | None], tokens: list[int]) -> None:
    """Each row's matcher takes the row's sampled token."""
    for matcher, token in zip(matchers, tokens):
        if matcher is not None:
            matcher.advance(token)
