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


# Bad input that used to end in a traceback: each is one `error:` line, checked in-process (no model is loaded
# for most of them: the checks run first).

def error_line(capsys, argv: list[str], main=None) -> str:
    from generate import main as generate_main

    assert (main or generate_main)(argv) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured
    return captured.err


@pytest.mark.parametrize("argv, fragment", [
    (["--prompt", "caf\udce9"], "--prompt is not valid UTF-8"),  # a non-UTF-8 byte, as surrogateescape hands it
    (["--prompt", "hi", "--seed", str(2**64)], "--seed must be in [-2**63, 2**64)"),
    (["--prompt", "hi", "--temperature", "inf"], "temperature must be >= 0 and finite"),
    (["--prompt", "hi", "--system", "terse"], "--system needs --chat"),
    (["--prompt", "hi", "--prompt-lookup", "--compile-prefill"], "--compile is not supported with speculative"),
])
def test_bad_flags_are_one_line_errors(capsys, argv, fragment):
    assert fragment in error_line(capsys, argv)


def test_unreadable_prompts_files(capsys, tmp_path, monkeypatch):
    assert "is a directory" in error_line(capsys, ["--prompts-file", str(tmp_path)])
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9\n")
    assert "is not UTF-8 text" in error_line(capsys, ["--prompts-file", str(bad)])
    locked = tmp_path / "locked.txt"
    locked.write_text("hi\n")
    real_open = open

    def no_permission(path, *args, **kwargs):  # chmod 000 does not stop root, who runs CI
        if str(path) == str(locked):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", no_permission)
    assert "cannot read prompts file" in error_line(capsys, ["--prompts-file", str(locked)])


def test_interactive_with_stdin_closed(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", None)  # what Python sets for `generate.py ... <&-`
    assert "stdin, which is closed" in error_line(capsys, ["--interactive", "--chat"])


def test_gguf_truncated_inside_its_metadata(capsys, tmp_path, smollm2_gguf):
    truncated = tmp_path / "truncated.gguf"
    with open(smollm2_gguf, "rb") as f:
        truncated.write_bytes(f.read(200_000))  # inside the vocabulary
    assert "cannot read GGUF file" in error_line(capsys, ["--model", str(truncated), "--prompt", "hi"])


def test_quantize_checks_its_output_folder_before_loading(capsys, tmp_path):
    from quantize import main as quantize_main

    (tmp_path / "file").write_text("mine")
    err = error_line(capsys, ["--mode", "int8", "--out", str(tmp_path / "file" / "out"),
                              "--model", str(tmp_path / "missing.gguf")], quantize_main)
    assert "is a file, not a folder" in err  # not the missing model: the folder is checked first
    assert (tmp_path / "file").read_text() == "mine"


def test_output_pipe_closed_early(smollm2_gguf):
    """`generate.py ... | head -c 5`: the reader goes away mid-stream; one error line, no traceback."""
    proc = subprocess.Popen([sys.executable, "generate.py", "--model", smollm2_gguf, "--prompt", "Count to fifty:",
                             "--temperature", "0", "--max-new-tokens", "200", "--quiet"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.read(5)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 1
    assert err == "error: the output pipe was closed\n", err
