"""A raw vocabulary -> a `tokenizers` backend: GGUF's (byte-level BPE or sentencepiece pieces with their scores,
types and merges) and a sentencepiece `tokenizer.model`'s, built as transformers builds them, so that encode and
decode match it. tokenizer.py wraps the backend."""

# Token types of GGUF `tokenizer.ggml.token_type` and of sentencepiece's ModelProto (the same enum).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4
# Pre-tokenizer regexes of byte-level BPE vocabularies, by llama.cpp's `tokenizer.ggml.pre` name.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")  # Qwen2 splits numbers into single digits
BYTE_LEVEL_PRE = {
    "default": None, "gpt2": None, "gpt-2": None,  # GPT-2's own regex, built into ByteLevel
    "smollm": "digits",  # SmolLM2's tokenizer.json: each digit alone, then GPT-2's regex
    "llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "llama-v3": LLAMA3_SPLIT,
    "qwen2": QWEN2_SPLIT, "deepseek-r1-qwen": QWEN2_SPLIT,
}


def byte_level_backend(tokens: list[str], merges: list[str], types: list[int], pre: str):
    """GPT-2 style byte-level BPE from a GGUF vocabulary and merges."""
    from tokenizers import Regex, Tokenizer as Backend, decoders, models, pre_tokenizers as pt

    if pre not in BYTE_LEVEL_PRE:
        raise ValueError(f"unsupported GGUF tokenizer.ggml.pre {pre!r}; supported: {sorted(BYTE_LEVEL_PRE)}")
    split = BYTE_LEVEL_PRE[pre]
    vocab = {t: i for i, t in enumerate(tokens)}
    # Llama 3 (and llama.cpp for it) takes a whole word straight from the vocabulary before trying merges
    model = models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges], ignore_merges=split == LLAMA3_SPLIT)
    backend = Backend(model)
    if split is None or split == "digits":
        byte_level = pt.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.pre_tokenizer = byte_level if split is None else pt.Sequence(
            [pt.Digits(individual_digits=True), byte_level])
    else:
        backend.pre_tokenizer = pt.Sequence([pt.Split(Regex(split), behavior="isolated"),
                                             pt.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    add_special_tokens(backend, tokens, types)
    return backend


def sentencepiece_backend(pieces: list[str], scores: list[float], types: list[int], prepend: str,
                           squeeze: bool = False):
    """SentencePiece BPE (Llama 2, Mistral) as a `tokenizers` BPE with byte fallback, as transformers builds it."""
    from tokenizers import Tokenizer as Backend, models

    vocab = {p: i for i, p in enumerate(pieces)}
    # sentencepiece merges the pair whose result scores highest; rebuild merges in that order
    normal = {p: i for i, p in enumerate(pieces) if types[i] == NORMAL}
    merges = []
    for piece, i in normal.items():
        pairs = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in normal and piece[k:] in normal]
        merges += [(a, b, scores[i]) for a, b in sorted(pairs, key=lambda p: (normal[p[0]], normal[p[1]]))]
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    backend = Backend(models.BPE(vocab, [(a, b) for a, b, _ in merges], fuse_unk=True, byte_fallback=True))
    sentencepiece_pipeline(backend, prepend, squeeze)
    add_special_tokens(backend, pieces, types)
    return backend


def sentencepiece_pipeline(backend, prepend: str, squeeze: bool = False) -> None:
    """sentencepiece's normalization: spaces as '▁', a '▁' dummy prefix per `prepend` (first/always/never), runs of
    spaces squeezed if `squeeze` (remove_extra_whitespaces); and the matching decoder."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers as pt

    # sentencepiece puts its '▁' before the text even when the text starts with a space (" Hello" -> "▁▁Hello"), but
    # Metaspace adds none to text that already starts with '▁' (transformers' Llama tokenizer has that bug). So the
    # normalizer turns spaces into '▁', a Metaspace whose mark is ' ' prefixes the text's first piece (which now never
    # starts with ' '), and a second Metaspace turns that ' ' into '▁' (and for "always" prefixes, as before, the text
    # after each special token unless it starts with a space).
    normalize = [normalizers.Replace(" ", "▁")]
    mark = [pt.Metaspace(replacement=" ", prepend_scheme="first", split=False)] if prepend != "never" else []
    if squeeze:
        # Runs of spaces become one and trailing ones go (in each piece between special tokens). A leading space left
        # is then the prefix itself, so it is deleted only when there is no prefix: deleting it would move the text
        # off offset 0, which is how Metaspace's "first" finds the text's first piece.
        normalize[:0] = [normalizers.Replace(Regex(" {2,}"), " "), normalizers.Replace(Regex(r" +\z"), "")]
        if prepend == "never":
            normalize.insert(0, normalizers.Replace(Regex(r"\A +"), ""))
        mark = []
    backend.normalizer = normalizers.Sequence(normalize)
    backend.pre_tokenizer = pt.Sequence(mark + [pt.Metaspace(replacement="▁", prepend_scheme=prepend, split=False)])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prepend != "never" or squeeze:  # drop one leading space, the prefix's, as sentencepiece does
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)


def add_special_tokens(backend, tokens: list[str], types: list[int]) -> None:
    """Match control/unknown tokens (special) and user-defined tokens (not special) whole in text."""
    from tokenizers import AddedToken

    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k in (UNKNOWN, CONTROL) and t])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == USER_DEFINED and t])


def read_sentencepiece_model(path: str) -> tuple[list[str], list[float], list[int], bool, bool]:
    """(pieces, scores, types, add_dummy_prefix, remove_extra_whitespaces) of a sentencepiece tokenizer.model."""
    from sentencepiece import sentencepiece_model_pb2  # needs protobuf

    proto = sentencepiece_model_pb2.ModelProto()
    try:
        with open(path, "rb") as f:
            proto.ParseFromString(f.read())
    except Exception as e:  # protobuf's DecodeError, or an OSError
        raise ValueError(f"cannot read sentencepiece model {path!r}: {e}") from None
    model_type = proto.trainer_spec.model_type
    if model_type != proto.trainer_spec.BPE:
        raise ValueError(f"{path!r}: sentencepiece model type {proto.trainer_spec.ModelType.Name(model_type)!r} "
                         "is not supported; only 'BPE' (Llama 2 / Mistral style)")
    pieces = [p.piece for p in proto.pieces]
    spec = proto.normalizer_spec
    return pieces, [p.score for p in proto.pieces], [p.type for p in proto.pieces], spec.add_dummy_prefix, \
        spec.remove_extra_whitespaces
