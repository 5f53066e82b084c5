"""Greedy is greedy on the default path: SmolLM2 as the README's command runs it (int4 codes, the dtype and step
`auto` picks) gives the same tokens decoded one row at a time, verified speculatively and batched, on both CPU
classes (AVX-512 natively where the machine has it; AVX2 forced with ATEN_CPU_CAPABILITY), and with `blocks`, the
step of a long answer, on AVX2 (where it runs the Q8_0 head's words, gemv.py)."""
import json

import pytest

from cli import pick_dtype
from helpers import run_py

PROMPTS = ["The three primary colors are", "Once upon a time, in a small village,",
           "def fibonacci(n):"]


@pytest.mark.slow
@pytest.mark.parametrize("capability, compile_mode", [(None, "auto"), ("avx2", "auto"), ("avx2", "blocks")])
def test_speculative_and_batched_greedy_equal_plain_greedy(smollm2_gguf, capability, compile_mode, monkeypatch):
    """auto: eager for these 128 tokens; blocks (a long answer's step) runs the Q8_0 head's words on AVX2."""
    if capability is not None:
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
    else:
        monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    result = run_py("tests/greedy_rows.py", "128", compile_mode, *PROMPTS, timeout=900)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    if capability is not None:
        assert out["capability"] == capability.upper()
        assert out["dtype"] == str(pick_dtype("auto", __import__("torch").device("cpu"), "AVX2")[0])
    for prompt, run in zip(PROMPTS, out["runs"]):
        plain = run.pop("plain")
        assert len(plain) == 128 or plain[-1] in (0, 1, 2), (prompt, len(plain))  # 128 tokens unless EOS came
        for name, tokens in run.items():
            same = next((i for i, (a, b) in enumerate(zip(plain, tokens)) if a != b), min(len(plain), len(tokens)))
            assert tokens == plain, f"{prompt!r}, {name}: differs from plain greedy at token {same} ({out['dtype']})"
