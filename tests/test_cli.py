"""The command line as a user runs it: real generation offline, and one clear line for each bad input."""
import json
import os
import subprocess
import sys

import pytest

from tiny_models import make_hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "generate.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]
    assert result.stdout == ""


def test_greedy_generation_with_the_default_model():
    result = run_cli("--prompt", "The capital of France is", "--temperature", "0", "--max-new-tokens", "16")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    summary = result.stderr.strip().splitlines()[-1]
    for field in ("prompt tokens 5", "generated tokens 16", "TTFT", "decode", "tokens/s"):
        assert field in summary


def test_chat_generation_stops_at_end_of_turn():
    result = run_cli("--prompt", "What is the capital of France?", "--chat", "--temperature", "0",
                     "--max-new-tokens", "64", "--quiet")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "<|im_end|>" not in result.stdout and result.stderr == ""


def test_missing_model_path(tmp_path):
    assert_one_line_error(run_cli("--prompt", "hi", "--model", str(tmp_path / "missing.gguf")),
                          "does not exist", "missing.gguf")


def test_unsupported_architecture(tmp_path):
    make_hf("llama-gqa").save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(run_cli("--prompt", "hi", "--model", str(tmp_path)),
                          "unsupported architecture 'GPTNeoXForCausalLM'")


def test_truncated_safetensors(tmp_path):
    make_hf("llama-gqa").save_pretrained(tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:1000])
    assert_one_line_error(run_cli("--prompt", "hi", "--model", str(tmp_path)), "cannot read safetensors file")


def test_prompt_longer_than_context():
    assert_one_line_error(run_cli("--prompt", "hello " * 9000, "--quiet"),
                          "longer than the model's context of 8191")


@pytest.mark.parametrize("flag, value, fragment", [
    ("--top-p", "1.5", "top_p must be in (0, 1]"),
    ("--temperature", "-1", "temperature must be >= 0"),
    ("--top-k", "-3", "top_k must be >= 0"),
    ("--max-new-tokens", "0", "--max-new-tokens must be >= 1"),
    ("--device", "tpu", "device 'tpu'"),
])
def test_invalid_arguments(flag, value, fragment):
    assert_one_line_error(run_cli("--prompt", "hi", flag, value), fragment)
