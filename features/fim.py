"""Fill-in-the-middle: a code model trained with FIM completes the gap between a prefix and a suffix when the
prompt is laid out prefix-suffix-middle (PSM): [BOS] <fim_prefix> prefix <fim_suffix> suffix <fim_middle>, and it
writes the middle. The tokens come from the vocabulary (GGUF metadata's ids, else their names). Torch-free: the
server (/v1/completions' suffix, /infill) builds its prompts here."""
from dataclasses import dataclass

# Each role's token names, as the families spell them: Qwen2.5-Coder, StarCoder (and SantaCoder's dashes),
# CodeLlama, DeepSeek-Coder. The first found is used.
NAMES = {
    "prefix": ("<|fim_prefix|>", "<fim_prefix>", "<fim-prefix>", "<PRE>", "▁<PRE>", "<｜fim▁begin｜>"),
    "suffix": ("<|fim_suffix|>", "<fim_suffix>", "<fim-suffix>", "<SUF>", "▁<SUF>", "<｜fim▁hole｜>"),
    "middle": ("<|fim_middle|>", "<fim_middle>", "<fim-middle>", "<MID>", "▁<MID>", "<｜fim▁end｜>"),
    "repo": ("<|repo_name|>", "<repo_name>", "<reponame>"),
    "file_sep": ("<|file_sep|>", "<file_sep>"),
    "pad": ("<|fim_pad|>", "<fim_pad>"),
}
# GGUF's `tokenizer.ggml.<key>_token_id` for each role (llama.cpp's names), read into Tokenizer.fim_ids
GGUF_KEYS = {"prefix": "fim_pre", "suffix": "fim_suf", "middle": "fim_mid", "repo": "fim_rep", "file_sep": "fim_sep",
             "pad": "fim_pad"}
REQUIRED = ("prefix", "suffix", "middle")
REPO_NAME = "myproject"  # the repository's name in a repo-level prompt (llama.cpp's placeholder)
CURRENT_FILE = "filename"  # the name of the file being edited, which requests do not give (llama.cpp's too)
SNIPPET = "\n\n--- snippet ---\n\n"  # separates extra chunks for a vocabulary without a file separator


@dataclass(frozen=True)
class FimTokens:
    """The ids of a vocabulary's FIM tokens; repo and file_sep (repository-level context) and pad may be missing."""
    prefix: int
    suffix: int
    middle: int
    repo: int | None = None
    file_sep: int | None = None
    pad: int | None = None

    def stops(self, tokenizer) -> list[str]:
        """The FIM tokens' texts, as stop strings: a middle ends there, as llama.cpp ends one at these tokens (any
        of them after the middle starts another file or another gap), when the model writes no EOS first."""
        ids = (self.prefix, self.suffix, self.middle, self.repo, self.file_sep, self.pad)
        texts = [tokenizer.decode([i]).strip() for i in ids if i is not None]  # CodeLlama's "▁<MID>" reads " <MID>"
        return [t for t in dict.fromkeys(texts) if t]


def find_fim_tokens(tokenizer) -> FimTokens:
    """The tokenizer's FIM tokens: the ids its GGUF metadata names (tokenizer.fim_ids), else the first of NAMES in
    its vocabulary. ValueError naming the missing ones for a model that has none (it was not trained for FIM)."""
    given = getattr(tokenizer, "fim_ids", None) or {}
    found = {}
    for role, names in NAMES.items():
        ids = [given.get(role)] + [tokenizer.backend.token_to_id(name) for name in names]
        found[role] = next((i for i in ids if i is not None), None)
    missing = [role for role in REQUIRED if found[role] is None]
    if missing:
        raise ValueError("this model has no fill-in-the-middle tokens (it was not trained for FIM): its vocabulary "
                         "lacks " + ", ".join(f"{role} ({' / '.join(NAMES[role][:2])})" for role in missing)
                         + ", and its GGUF metadata names none (tokenizer.ggml.fim_pre_token_id, ...)")
    return FimTokens(**found)


def infill_prompt(tokenizer, fim: FimTokens, prefix: str, suffix: str, extra: list[tuple[str, str]] = (),
                  prompt: str = "") -> list[int]:
    """The PSM prompt's ids: [BOS] [extra context] <prefix> prefix + prompt <suffix> suffix <middle>. extra:
    (filename, text) chunks of other files, given as a repository (Qwen2.5-Coder's repo-level layout: <repo_name>
    name, then <file_sep> filename\\n text per file and one for the current file) when the vocabulary has a file
    separator, else joined by a snippet line. The texts are text: a special token's name in them is characters."""
    def text(s: str) -> list[int]:
        return tokenizer.text_backend().encode(s, add_special_tokens=False).ids if s else []  # no BOS, no EOS

    ids = [tokenizer.bos_id] if tokenizer.add_bos else []
    if extra:
        if fim.repo is not None and fim.file_sep is not None:
            ids += [fim.repo, *text(REPO_NAME + "\n")]
        for filename, chunk in extra:
            ids += [fim.file_sep, *text(filename + "\n")] if fim.file_sep is not None else text(SNIPPET)
            ids += text(chunk)
        if fim.file_sep is not None:
            ids += [fim.file_sep, *text(CURRENT_FILE + "\n")]
    # prompt continues the prefix: the text the middle starts with (llama.cpp puts it there too)
    return ids + [fim.prefix, *text(prefix + prompt), fim.suffix, *text(suffix), fim.middle]
