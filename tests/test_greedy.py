"""Greedy is greedy across row counts: SmolLM2 on the default path (int4 codes, the dtype `auto` picks) gives plain
greedy's tokens (one row, decode.generate) verified speculatively and batched, on both CPU classes (AVX-512 natively
where the machine has it; AVX2 forced with ATEN_CPU_CAPABILITY). Two steps: the README's first command's (`auto`,
which is eager for a short answer), and the compiled blocks (what `auto` runs for a long answer; on AVX2 its head
is the Q8_0 head's words, gemv.py)."""
import json

import pytest
import torch

from cli import pick_dtype
from helpers import cpu_classes, run_py

README_PROMPT = "The capital of France is"  # README: python generate.py --prompt "The capital of France is" --temperature 0
PROMPTS = ["The three primary colors are", "Once upon a time, in a small village,", "def fibonacci(n):"]
N_TOKENS = 64


def greedy_rows(capability: str | None, compile_mode: str, prompts: list[str], monkeypatch) -> dict:
    """tests/greedy_rows.py's JSON, run in a process of the CPU class `capability` (None: this machine's own)."""
    if capability is not None:
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
    else:
        monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    result = run_py("tests/greedy_rows.py", str(N_TOKENS), compile_mode, *prompts, timeout=900)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    if capability is not None:
        assert out["capability"] == capability.upper()
        assert out["dtype"] == str(pick_dtype("auto", torch.device("cpu"), "AVX2")[0])
    return out


def assert_plain_greedy(out: dict, prompts: list[str]) -> None:
    """Every run of every prompt gave the plain one-row greedy tokens."""
    for prompt, run in zip(prompts, out["runs"], strict=True):
        plain = run.pop("plain")
        assert len(plain) == N_TOKENS or plain[-1] in (0, 1, 2), (prompt, len(plain))  # N_TOKENS unless EOS came
        for name, tokens in run.items():
            same = next((i for i, (a, b) in enumerate(zip(plain, tokens)) if a != b), min(len(plain), len(tokens)))
            assert tokens == plain, f"{prompt!r}, {name}: differs from plain greedy at token {same} ({out['dtype']})"


@pytest.mark.slow
@pytest.mark.parametrize("capability", cpu_classes())  # None repeats avx2 on an AVX2 machine
def test_the_readme_commands_eager_step_is_greedy(capability, monkeypatch):
    """The README's first command, its answer short: `--compile auto` picks eager (the target's step and a draft's),
    generate.py itself prints plain greedy's tokens and says it ran eagerly, and speculative and batched greedy on
    that step give the same tokens."""
    prompts = [README_PROMPT, *PROMPTS]
    out = greedy_rows(capability, "auto", prompts, monkeypatch)
    assert out["modes"] == ["none", "none"], out["modes"]
    command = run_py("generate.py", "--prompt", README_PROMPT, "--temperature", "0", "--max-new-tokens",
                     str(N_TOKENS), "--json", timeout=600)  # ATEN_CPU_CAPABILITY as greedy_rows' process had it
    assert command.returncode == 0, command.stderr
    assert "eager (auto: a compile pays after" in command.stderr.strip().splitlines()[-1], command.stderr
    assert json.loads(command.stdout)["tokens"] == out["runs"][0]["plain"]
    assert_plain_greedy(out, prompts)


@pytest.mark.slow
def test_the_compiled_blocks_are_greedy(monkeypatch):
    """`--compile blocks` (auto's step for a long answer), on AVX2, where the head runs the Q8_0 head's words: the
    compiled step's speculative and batched greedy give its plain greedy tokens."""
    out = greedy_rows("avx2", "blocks", PROMPTS, monkeypatch)
    assert out["modes"] == ["blocks", "blocks"], out["modes"]  # compiled, not fallen back to eager
    assert_plain_greedy(out, PROMPTS)
