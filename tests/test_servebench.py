"""scripts/servebench.py: the servers the flags ask for (peers skipped with a line), the table (a failed server
says why), and one real run of serve.py alone (slow)."""
import argparse

import pytest

from scripts import servebench


def args(**more) -> argparse.Namespace:
    return servebench.build_parser().parse_args([f"--{k.replace('_', '-')}={v}" for k, v in more.items()])


def test_peers_are_optional_and_started_as_asked(capsys):
    plain = servebench.servers(args(model="m.gguf", ours="--dtype bfloat16 --compile full"), 8123)
    assert [s.name for s in plain] == ["serve.py"] and plain[0].argv[-4:] == ["--dtype", "bfloat16", "--compile",
                                                                              "full"]
    err = capsys.readouterr().err
    assert "vLLM-CPU: skipped (no --vllm)" in err and "llama-server: skipped (no --llama-server)" in err
    both = servebench.servers(args(model="m.gguf", vllm="/v/vllm", vllm_model="hf-folder", llama_server="/l/srv"),
                              9000)
    assert [s.name for s in both] == ["serve.py", "vLLM-CPU", "llama-server"]
    assert both[1].argv[:3] == ["/v/vllm", "serve", "hf-folder"] and both[1].env == {"VLLM_TARGET_DEVICE": "cpu"}
    assert both[2].argv[:3] == ["/l/srv", "-m", "m.gguf"] and "-np" in both[2].argv  # the slots for 32 streams


def test_the_table_has_a_row_per_point_and_says_why_a_server_failed():
    point = {"value": 8, "output_tokens_per_s": 150.0, "requests_per_s": 1.17, "ttft_p50_s": 0.1, "ttft_p99_s": 0.25,
             "tpot_p50_s": 0.05, "tpot_p99_s": 0.06}
    ok = servebench.Server("serve.py", [], startup_s=3.2, peak_rss_bytes=1.15e9, points=[point])
    bad = servebench.Server("vLLM-CPU", [], error="it exited with code 1 before serving", peak_rss_bytes=2e8)
    rows = servebench.table([ok, bad]).splitlines()
    assert rows[2] == "| serve.py | 8 | 150.0 | 1.17 | 100 / 250 | 50 / 60 | 3.2 | 1.15 |"
    assert rows[3].startswith("| vLLM-CPU | failed: it exited with code 1 before serving |")


def test_rounds_scale_the_requests_with_the_streams():
    fixed = servebench.load_args(args(requests=5), "http://127.0.0.1:1", 8)
    assert fixed.concurrency == [8] and fixed.requests == 5 and fixed.ignore_eos
    assert servebench.load_args(args(rounds=3), "http://127.0.0.1:1", 8).requests == 24
    with pytest.raises(ValueError, match="--rounds must be >= 1"):
        servebench.run(args(rounds=0))


@pytest.mark.slow
def test_serve_py_alone_through_the_benchmark(tmp_path, capsys):
    """One concurrency, two short requests: the start-up is timed, the peak RSS read, the EOS ignored."""
    out = tmp_path / "bench.json"
    assert servebench.main(["--concurrency", "1", "--requests", "2", "--max-tokens", "4", "--min-words", "5",
                            "--max-words", "10", "--port", "8131", "--json", str(out), "--logs",
                            str(tmp_path / "logs")]) == 0
    import json

    (result,) = json.loads(out.read_text())
    assert result["error"] is None and result["startup_s"] > 0 and result["peak_rss_bytes"] > 10 ** 8
    (point,) = result["points"]
    assert point["ok"] == 2 and point["output_tokens"] == 8  # ignore_eos: all 4 tokens each
    assert "| serve.py | 1 |" in capsys.readouterr().out
