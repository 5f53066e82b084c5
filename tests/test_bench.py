"""bench.py: the capacity-plan arithmetic and a benchmark run end to end on a tiny model."""
import dataclasses
import json

import pytest
import torch

from scripts import bench
from model import Transformer
from models.families import build_model


def test_param_counts_match_the_models():
    assert bench.param_count(bench.SHAPES["llama-2-7b"]) == 6_738_415_616  # Llama-2-7B's published count
    for name, args in bench.SHAPES.items():
        if name.startswith("deepseek"):  # V3's 61 x 256 experts take 14 s to build, even on the meta device
            args = dataclasses.replace(args, n_layers=4, n_experts=16)
        with torch.device("meta"):
            model = build_model(args)
        assert bench.param_count(args) == sum(p.numel() for p in model.parameters()), name


def test_plan_llama2_7b_fp16(capsys):
    assert bench.main(["--plan", "--shape", "llama-2-7b", "--bandwidth-gbs", "4800"]) == 0
    out = capsys.readouterr().out
    assert "KV cache: 512 KiB/token, 2 GiB per sequence at 4096 tokens" in out
    bf16 = next(line for line in out.splitlines() if line.strip().startswith("bf16"))
    # 12.55 GiB of weights leave 67.45 GiB: 33 sequences of 2 GiB; 4800 GB/s / 13.48 GB = 356 tok/s
    assert bf16.split()[1:4] == ["12.55", "33", "356.2"]


def test_kv_table_mla(capsys):
    """MLA caches its latent: (kv_lora_rank + rope dims) x layers x 2 bytes; DeepSeek-V3's 61 layers x 576 x 2 bytes
    against Llama-2-7B's 32 x 2 x 32 heads x 128 x 2."""
    assert bench.main(["--kv-table", "--context", "32768"]) == 0
    rows = {r.split("|")[1].strip(): r.split("|")[2:5] for r in capsys.readouterr().out.splitlines()[2:]}
    token = 61 * 576 * 2
    assert [c.strip() for c in rows["deepseek-v3"]] == ["MLA", f"{token / 1024:g}", f"{token * 32768 / 2**30:.3g}"]
    assert [c.strip() for c in rows["llama-2-7b"]] == ["MHA", "512", "16"]
    # the published totals: 15.7 B (2.4 B active, ours 2.7 B with the embeddings) and 671 B (37 B active)
    assert round(bench.param_count(bench.SHAPES["deepseek-v2-lite"]) / 1e9, 1) == 15.7
    assert int(bench.param_count(bench.SHAPES["deepseek-v3"]) / 1e9) == 671


def test_plan_mistral_7b_gqa(capsys):
    assert bench.main(["--plan", "--shape", "mistral-7b", "--bandwidth-gbs", "4800"]) == 0
    assert "KV cache: 128 KiB/token, 0.5 GiB per sequence at 4096 tokens" in capsys.readouterr().out


@pytest.mark.slow
def test_benchmark_table_and_json(tiny_dir, tmp_path, capsys):
    out_file = tmp_path / "result.json"
    assert bench.main(["--model", tiny_dir, "--dtype", "float32", "--runs", "2", "--new-tokens", "6",
                       "--prompt-len", "5", "9", "--json", str(out_file), "--quiet", "--profile"]) == 0
    out = capsys.readouterr().out
    assert "measured memory bandwidth" in out and "% roofline" in out
    profile = out[out.index("profile of 5 decode steps (batch 1):"):]  # --profile: the top ops by their own time
    assert "aten::mm" in profile or "aten::linear" in profile
    result = json.loads(out_file.read_text())
    assert [r["prompt_len"] for r in result["results"]] == [5, 9]
    r = result["results"][0]
    # tiny-llama-gqa: 2 layers x 2 kv heads x head_dim 24, fp32 -> 2 * 2 * 2 * 24 * 4 bytes per token
    assert r["kv_bytes_per_token"] == 768 and r["kv_bytes_total"] == 768 * (5 + 6)
    assert r["tpot_ms"] > 0 and r["decode_tok_s"] > 0 and r["weight_bytes"] > 0


@pytest.mark.slow
def test_engine_benchmark_and_the_table_of_runs(tiny_dir, tmp_path, capsys):
    """--engine: each batch size decoded together by the serving engine, the step time beside the 1-row step's;
    --table: the --json files of several runs as one table, each decode speed beside the float weights' run."""
    engine_json, float_json, int8_json = (tmp_path / f"{n}.json" for n in ("engine", "float", "int8"))
    common = ["--model", tiny_dir, "--dtype", "float32", "--runs", "1", "--new-tokens", "5", "--prompt-len", "6",
              "--compile", "none", "--quiet"]
    assert bench.main([*common, "--engine", "--batch-size", "1", "3", "--json", str(engine_json)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("engine: ") and "step / 1-row step" in out
    result = json.loads(engine_json.read_text())
    assert result["engine"] and [r["batch_size"] for r in result["results"]] == [1, 3]
    one, three = result["results"]
    assert one["step_vs_1"] == 1 and three["step_vs_1"] == three["tpot_ms"] / one["tpot_ms"]
    assert three["decode_tok_s"] == pytest.approx(3e3 / three["tpot_ms"])
    assert three["kv_bytes_total"] == 768 * 3 * (6 + 5)  # as test_benchmark_table_and_json's model
    assert bench.main([*common, "--json", str(float_json)]) == 0
    assert bench.main([*common, "--quantize", "int8", "--json", str(int8_json)]) == 0
    capsys.readouterr()
    assert bench.main(["--table", str(engine_json), str(float_json), str(int8_json)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {(cells[0], cells[5]): cells for cells in (line.split(" | ") for line in lines[1:4])}
    assert set(rows) == {("engine", "1"), ("engine", "3"), ("float", "1")} and lines[4].startswith("int8 | ")
    int8, base = lines[4].split(" | "), json.loads(float_json.read_text())["results"][0]
    assert int8[2] == "int8" and int8[4] == "generate"
    assert int8[11] == f"{json.loads(int8_json.read_text())['results'][0]['decode_tok_s'] / base['decode_tok_s']:.2f}x"
    assert rows["engine", "3"][12] == f"{three['step_vs_1']:.2f}x" and int8[12] == ""
    assert lines[-1].startswith("int8: cpu torch.float32, measured ")


def test_bad_arguments(cli_error):
    assert "--plan needs --shape" in cli_error(bench.main, ["--plan"])
    assert "--new-tokens must be >= 2" in cli_error(bench.main, ["--shape", "llama-2-7b", "--new-tokens", "1"])
    assert "--prompt-len must be >= 1" in cli_error(bench.main, ["--shape", "llama-2-7b", "--prompt-len", "0"])
    assert "--engine takes one --prompt-len" in cli_error(bench.main, ["--engine", "--prompt-len", "8", "16"])
    assert "--table: cannot read 'missing.json'" in cli_error(bench.main, ["--table", "missing.json"])


def test_mixtral_counts_and_plan(capsys):
    args = bench.SHAPES["mixtral-8x7b"]
    assert bench.param_count(args) == 46_702_792_704  # Mixtral-8x7B's published count (46.7 B)
    assert bench.param_count(args, active=True) == 12_879_925_248  # 2 of 8 experts: the published 12.9 B active
    assert bench.main(["--plan", "--shape", "mixtral-8x7b", "--bandwidth-gbs", "4800", "--memory-gib", "141"]) == 0
    out = capsys.readouterr().out
    assert "reads 2 of 8 experts per layer, 12.88 B active parameters (27.6%)" in out
    bf16 = next(line for line in out.splitlines() if line.strip().startswith("bf16"))
    # 86.99 GiB held, 23.99 GiB read per step: 4800 GB/s / 25.76 GB = 186 tok/s (a dense 47 B model: 51)
    assert bf16.split()[1:4] == ["86.99", "108", "186.3"] and bf16.split()[-1] == "23.99"


@pytest.mark.slow
def test_mixtral_benchmark_counts_active_bytes(tmp_path, capsys):
    """A tiny Mixtral benchmarked end to end; a batch-1 step reads k of E experts' bytes, a batch more of them."""
    from tiny_models import hf_to_ours, make_hf

    hf = make_hf("mixtral-8x2")
    hf.save_pretrained(tmp_path / "m")
    assert bench.main(["--model", str(tmp_path / "m"), "--dtype", "float32", "--runs", "1", "--new-tokens", "4",
                       "--prompt-len", "5", "--quiet"]) == 0
    assert "% roofline" in capsys.readouterr().out
    model = hf_to_ours(hf)
    expert = sum(p.numel() * 4 for layer in model.layers for p in layer.mlp.experts[0].parameters())
    total = sum(p.numel() * 4 for p in model.parameters()) - model.embed_tokens.weight.nbytes  # one row read
    assert bench.step_weight_bytes(model, 1) == total - 6 * expert  # 8 experts, 2 read
    assert total - 6 * expert < bench.step_weight_bytes(model, 4) < total


def test_a_step_reads_the_embedding_only_as_the_head(tiny):
    """A dense step reads every weight but an embedding that is not also the head (it reads a row of that)."""
    from tiny_models import hf_to_ours, make_hf
    from quantize import weight_bytes

    assert bench.step_weight_bytes(tiny, 1) == weight_bytes(tiny) - tiny.embed_tokens.weight.nbytes  # untied
    tied = hf_to_ours(make_hf("llama-tied"))
    assert bench.step_weight_bytes(tied, 1) == weight_bytes(tied)


def test_mask_cost_walks_the_grammar():
    """bench.mask_cost on a toy vocabulary: both modes time every step, and the walk restarts a completed grammar."""
    from features.grammar import Compiler, Constraint
    from tokenizer import tokenizer_from_gguf_metadata

    tokens = ["<end>", *"0123456789"]
    toy = tokenizer_from_gguf_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
                                        "tokenizer.ggml.merges": [], "tokenizer.ggml.eos_token_id": 0,
                                        "tokenizer.ggml.token_type": [3] + [1] * 10})
    grammar = Compiler(toy, 16).compile(Constraint("regex", "[0-9]{2}"))
    cost = bench.mask_cost(grammar, 16, 3, 7, torch.device("cpu"))
    assert set(cost) == {"batched", "per_row"} and min(cost.values()) > 0


def test_step_vs_generate_and_the_long_prompt_case(tiny):
    """--vs-generate: a decode step's CPU time in generate.py's loop and the engine's, per batch (and the wide
    engine's with --wide-rows, here an int4 copy); --long-prompt: the streams' ITL alone and while a long prompt is
    prefilled in chunks of --prefill-chunk, whose gaps all fall in that prefill."""
    import copy

    from quantize import quantize_model
    from serving.engine import EngineConfig
    from step import Step

    model = quantize_model(copy.deepcopy(tiny), "int4:32")
    rows = bench.step_vs_generate(model, Step(model), [1, 3], 6, 8, wide_rows=2)
    assert [r["batch_size"] for r in rows] == [1, 3]
    assert all(r["generate_ms"] > 0 and r["engine_ms"] > 0 and r["wide_ms"] > 0 for r in rows)
    config = EngineConfig(block_size=4, num_blocks=64, max_running=3, token_budget=16, prefill_chunk=5)
    alone, loaded = bench.long_prompt_bench(tiny, Step(tiny), 2, 4, 40, config)
    assert alone["ttft_s"] is None and loaded["ttft_s"] > 0
    # 40 tokens in chunks of 5: 8 steps, each a gap of both streams (the last one's gap ends with the first token)
    assert loaded["samples"] == 2 * 8 and alone["samples"] == 2 * (8 + 40 // 5 - 2)
    assert alone["itl_cpu_p50_ms"] <= alone["itl_cpu_p99_ms"]


def test_percentile_is_nearest_rank():
    assert bench.percentile([3, 1, 2, 4], 50) == 2 and bench.percentile([3, 1, 2, 4], 99) == 4
    assert bench.percentile(list(range(1, 101)), 99) == 99 and bench.percentile([7], 1) == 7
