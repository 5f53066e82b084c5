"""Generation controls from the command line: a --prompts-file batch with --json, --stop and --logprobs,
--interactive chat, and one clear error line for each bad value."""
import json
import re
import subprocess
import sys

import pytest

from generate import main
from test_cli import ROOT, assert_one_line_error, run_cli


@pytest.mark.parametrize("args, fragment", [
    (["--prompt", "hi", "--stop", ""], "stop strings must be non-empty, got ''"),
    (["--prompt", "hi", "--logprobs", "-1"], "--logprobs must be >= 0"),
    (["--prompt", "hi", "--min-p", "2"], "min_p must be in [0, 1]"),
    (["--prompts-file", "EMPTY"], "has no prompts"),
])
def test_invalid_control_arguments(args, fragment, tmp_path):
    (tmp_path / "prompts.txt").write_text("\n  \n")
    args = [str(tmp_path / "prompts.txt") if a == "EMPTY" else a for a in args]
    assert_one_line_error(run_cli(*args), fragment)


@pytest.mark.parametrize("args, fragment", [
    (["--prompt", "hi", "--repetition-penalty", "0"], "repetition_penalty must be > 0"),
    (["--prompt", "hi", "--frequency-penalty", "5"], "frequency_penalty must be in [-2, 2]"),
    (["--prompts-file", "nope.txt"], "prompts file 'nope.txt' does not exist"),
    (["--prompts-file", "nope.txt", "--prompt", "hi"], "either --prompt or --prompts-file, not both"),
    (["--interactive"], "--interactive needs --chat"),
    ([], "no prompt: pass --prompt TEXT, --prompts-file F, or --interactive with --chat"),
])
def test_invalid_control_arguments_in_process(args, fragment, capsys):
    """The same error path without a subprocess: these fail before any model is loaded."""
    assert main(args) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"error: {captured.err.removeprefix('error: ')}"
    assert fragment in captured.err and captured.err.count("\n") == 1


def test_prompts_file_with_json_stop_string_and_logprobs(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The capital of France is\n\nOnce upon a time, there was a\ndef add(a, b):\n1, 2, 3,\n")
    result = run_cli("--prompts-file", str(prompts), "--temperature", "0", "--max-new-tokens", "8",
                     "--stop", "\n\nThe answer", "--logprobs", "2", "--json")
    assert result.returncode == 0, result.stderr
    outs = [json.loads(line) for line in result.stdout.splitlines()]  # one JSON object per prompt, in order
    assert len(outs) == 4  # the blank line is not a prompt
    assert "prompts 4 | prompt tokens" in result.stderr.strip().splitlines()[-1]
    out = outs[0]
    assert out["text"] == " Paris." and out["finish_reason"] == "stop"
    assert out["prompt_tokens"] == 5 and len(out["tokens"]) == 6  # up to ' answer', which completed the stop
    assert {o["finish_reason"] for o in outs[1:]} <= {"length", "eos"}
    for o in outs:
        assert [lp["token"] for lp in o["logprobs"]] == o["tokens"]
        for lp in o["logprobs"]:
            assert len(lp["top"]) == 2 and lp["top"][0]["logprob"] >= lp["top"][1]["logprob"]
            assert lp["top"][0]["token"] == lp["token"] and lp["top"][0]["logprob"] == lp["logprob"]  # greedy
        assert set(o["timings"]) == {"ttft_ms", "total_ms", "decode_tokens_per_s"}


def test_interactive_chat_prefills_only_the_new_turn():
    result = subprocess.run([sys.executable, "generate.py", "--chat", "--interactive", "--temperature", "0",
                             "--max-new-tokens", "40"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            input="What is the capital of France?\nAnd of Germany?\n")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout and "Berlin" in result.stdout
    turns = [re.search(r"prompt tokens (\d+) \| prefilled (\d+)", line).groups()
             for line in result.stderr.splitlines() if line.startswith("turn ")]
    assert len(turns) == 2
    (prompt1, prefilled1), (prompt2, prefilled2) = [tuple(map(int, t)) for t in turns]
    assert prefilled1 == prompt1 and prefilled2 < 20 < prompt2
