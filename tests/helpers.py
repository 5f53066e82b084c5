"""Plain helpers shared by the test files (fixtures are in conftest.py): the repository root, running a script
in a fresh Python process, its peak memory, a toy tokenizer whose text shows every token and a toy byte-level BPE
one for grammars, an API answer's stream of pieces, a distributed
rank's device, the CPU classes to run a process under."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_classes() -> list[str | None]:
    """The CPU classes (ATEN_CPU_CAPABILITY) a test runs its process under: None (the machine's own) and "avx2"; on
    an AVX2 machine, none forced, "avx2" alone, since the machine's own class is the one it forces."""
    import torch

    own_is_avx2 = "ATEN_CPU_CAPABILITY" not in os.environ and torch.backends.cpu.get_cpu_capability() == "AVX2"
    return ["avx2"] if own_is_avx2 else [None, "avx2"]


def child_env() -> dict[str, str]:
    """The environment for a test's child process: one thread, as the tests run (see conftest.py)."""
    return dict(os.environ, OMP_NUM_THREADS="1")


def run_py(*args: str, input: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python ARGS...` in the repository root, as a user runs it."""
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, input=input,
                          timeout=timeout, env=child_env())


# Source of peak_rss(), the process's peak RSS in bytes, for test subprocesses to exec. Not getrusage's
# ru_maxrss: Linux carries that across exec, so a child of the (large) pytest process starts at its peak.
PEAK_RSS = ("def peak_rss():\n"
            "    with open('/proc/self/status') as f:\n"
            "        return next(int(l.split()[1]) * 1024 for l in f if l.startswith('VmHWM:'))")


class ToyTokenizer:
    """Token i is the text '<i>'; no EOS unless given."""

    def __init__(self, eos_ids=()):
        self.eos_ids = list(eos_ids)

    def decode(self, ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)

    def stream(self):
        class Decoder:
            def push(self, token):
                return f"<{token}>"

            def flush(self):
                return ""
        return Decoder()


def complete_greedy(model, tokenizer, prompt: list[int], max_new_tokens: int, *, stop=(), on_text=None,
                    session=None):
    """text.complete over greedy decode.generate, ending at the tokenizer's EOS ids (generate.py's path). With a
    session, the Completion's `prefilled` counts only the prompt tokens the session's cache did not hold."""
    from decode import generate
    from text import complete

    prefilled = len(prompt) - (session.reusable(prompt) if session is not None else 0)
    tokens = generate(model, prompt, max_new_tokens=max_new_tokens, stop_ids=tokenizer.eos_ids, session=session)
    return complete(tokens, tokenizer, len(prompt), prefilled, stop=stop, on_text=on_text)


def byte_level_char(b: int) -> str:
    from features.grammar import byte_level_table

    return {v: k for k, v in byte_level_table().items()}[b]


def toy_bpe(specials: tuple[str, ...] = (), **meta):
    """A byte-level BPE tokenizer of printable ASCII and a few merges (104 ids), EOS id 0, as a GGUF embeds one;
    specials: control tokens after them (ids 104, ...); meta: more `tokenizer.ggml.*` metadata (key without the
    prefix)."""
    from tokenizer import tokenizer_from_gguf_metadata

    chars = [byte_level_char(b) for b in range(32, 127)]
    merges = ['{ "', '" :', "Ġ \"", '" ,', "t r", "tr u", "tru e", "1 2"]
    tokens = ["<|end|>", *chars, *(m.replace(" ", "") for m in merges), *specials]
    types = [3] + [1] * (len(tokens) - 1 - len(specials)) + [3] * len(specials)
    return tokenizer_from_gguf_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
                                         "tokenizer.ggml.merges": merges, "tokenizer.ggml.eos_token_id": 0,
                                         "tokenizer.ggml.token_type": types,
                                         **{f"tokenizer.ggml.{k}": v for k, v in meta.items()}})


def stream_pieces(answer, pieces: list[str]) -> list[str]:
    """The stream lines of an API answer (opening, then one Event a piece, the last ending on EOS) for one choice."""
    from serving.contract import Event

    lines = answer.opening()
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        lines += answer.add(0, Event(0, piece, [k], last, "eos" if last else None, 9, k + 1, 0))
    return lines


def rank_device(rank: int, device: str) -> str:
    """A rank's device ("cpu", or its own GPU: cuda:RANK) once its process group is up (gloo, or NCCL on CUDA)."""
    import torch
    import torch.distributed as dist

    if device == "cpu":
        dist.init_process_group("gloo")
        return device
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    return f"cuda:{rank}"


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM a server process (it drains and exits), SIGKILL it after 40 s."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=40)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
