"""scripts/servebench.py: the servers the flags ask for (peers skipped with a line), the table (a failed server
says why), the long-prompt case's windows and table, and real runs of serve.py alone (slow)."""
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


def test_the_gaps_split_at_the_long_prompts_sending_and_first_token():
    """Gaps that end by the sending are alone, those that overlap (sending, first token) are with it; each stream's
    first `settle` gaps are in neither."""
    a = [0, 10, 11, 13, 16, 20, 25, 31, 38]  # gaps 10 1 | 2 3 | 4 5 6 | 7 (starts at the first token: out)
    b = [1, 2, 3, 4, 15, 17, 40]  # gaps 1 1 | 1 11 (ends at the sending) | 2 (straddles it) 23 (straddles the first)
    alone, with_long = servebench.split_gaps([a, b], sent_s=16, first_s=31, settle=2)
    assert alone == [2, 3, 1, 11] and with_long == [4, 5, 6, 2, 23]
    assert servebench.split_gaps([a], sent_s=16, first_s=31, settle=0) == ([10, 1, 2, 3], [4, 5, 6])
    assert servebench.split_gaps([a[:3]], sent_s=16, first_s=31, settle=2) == ([], [])  # too short to sample


def test_the_long_summary_pools_the_rounds_and_the_table_has_a_row_per_server():
    rounds = [{"prompt_tokens": 1990, "ttft_s": 3.0, "alone_gaps_s": [0.01, 0.02], "with_gaps_s": [0.03, 0.09]},
              {"prompt_tokens": 2010, "ttft_s": 5.0, "alone_gaps_s": [0.03], "with_gaps_s": [0.05, 0.07]}]
    x = servebench.long_summary(rounds, 4)
    assert x["samples_alone"] == 3 and x["samples_with"] == 4 and x["prompt_tokens"] == 2000
    assert x["itl_alone_p50_s"] == pytest.approx(0.02) and x["itl_alone_p99_s"] == pytest.approx(0.0298)
    assert x["itl_with_p50_s"] == pytest.approx(0.06) and x["itl_with_p99_s"] == pytest.approx(0.0894)
    assert x["p99_ratio"] == pytest.approx(0.0894 / 0.0298) and x["ttft_p50_s"] == pytest.approx(4.0)
    ok = servebench.Server("serve.py", [], startup_s=3.2, peak_rss_bytes=1.15e9, long=x)
    bad = servebench.Server("llama-server", [], startup_s=1.5, error="the long prompt failed: HTTP 400")
    rows = servebench.long_table([ok, bad]).splitlines()
    assert rows[2] == "| serve.py | 4 | 20 / 30 | 60 / 89 | 3.00x | 2000 | 4.00 | 3.2 | 1.15 |"
    assert rows[3] == "| llama-server | failed: the long prompt failed: HTTP 400 | | | | | | 1.5 | 0.00 |"


def test_the_long_prompt_is_seeded_words_and_llama_server_has_a_slot_and_room_for_it():
    import random

    one, again = (servebench.long_text(2000, random.Random("0:long:0")) for _ in range(2))
    assert one == again and len(one.split()) == 1600 and one != servebench.long_text(2000, random.Random("0:long:1"))
    (llama,) = servebench.servers(args(llama_server="/l/srv", long_prompt=2000, long_streams=6), 9000)[1:]
    assert llama.argv[llama.argv.index("-np") + 1] == "7"  # the streams and the long prompt
    with pytest.raises(ValueError, match="--llama-ctx 8192 over 7 slots leaves 1170 tokens a slot"):
        servebench.check_llama_ctx(args(llama_server="/l/srv", long_prompt=2000, long_streams=6, llama_ctx=8192))
    servebench.check_llama_ctx(args(llama_server="/l/srv", long_prompt=2000, long_streams=6))  # 32768: room
    with pytest.raises(ValueError, match="--long-streams must be >= 1"):
        servebench.run(args(long_prompt=100, long_streams=0))


@pytest.mark.slow
def test_serve_py_alone_through_the_long_prompt_case(tmp_path, capsys):
    """Two streams, a ~200-token prompt prefilled 8 tokens a step: gaps in both windows, its TTFT timed."""
    out = tmp_path / "long.json"
    assert servebench.main(["--long-prompt", "200", "--long-streams", "2", "--long-stream-tokens", "512",
                            "--min-words", "5", "--max-words", "10", "--ours=--prefill-chunk 8", "--port", "8133",
                            "--json", str(out), "--logs", str(tmp_path / "logs")]) == 0
    import json

    (result,) = json.loads(out.read_text())
    assert result["error"] is None and result["points"] == []
    x = result["long"]
    (r,) = x["rounds"]
    assert len(r["alone_gaps_s"]) >= 2 * servebench.ALONE_TOKENS and r["with_gaps_s"] and r["ttft_s"] > 0
    assert 150 < r["prompt_tokens"] < 260 and x["itl_with_p99_s"] > 0
    assert "| serve.py | 2 |" in capsys.readouterr().out


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
