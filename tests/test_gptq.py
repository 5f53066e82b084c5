"""gptq.py: GPTQ's blocked solve against a direct column-by-column OBS reference and against round-to-nearest on the
calibration inputs; AWQ's folded scales leave the float model's function unchanged; act-order checkpoints reload
exactly."""
import copy
import re

import pytest
import torch
import torch.nn.functional as F

from features.gptq import (awq_fold, awq_scale, gptq_solve, input_stats, int4_params, learn_rounding, learned_int4,
                  quantize_calibrated, round_column, rtn_weight, sampled_sequences, tune_grid)
from load import load_model
from model import RMSNorm
from quantize import Int4Linear, dequantize_int4, quantize_int4, unpermute_columns


def layer(n=24, k=128, m=400, seed=0, dtype=torch.float64):
    """A random linear (N, K) and calibration inputs (M, K) with correlated channels of varied size, as a model's."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) @ (torch.eye(k) + torch.randn(k, k, generator=gen) / k ** 0.5)
    x = x * torch.exp(torch.randn(k, generator=gen))  # a few large channels
    return torch.randn(n, k, generator=gen).to(dtype), x.to(dtype)


def gptq_reference(w, H, group, damp=0.01):
    """GPTQ written directly: round column i, then the OBS update of every later column with the inverse Hessian
    of the columns still free, which then loses column i (no Cholesky, no blocks)."""
    W = w.clone()
    Hinv = torch.linalg.inv(H + damp * H.diagonal().mean() * torch.eye(H.shape[0], dtype=H.dtype))
    codes = torch.empty(W.shape, dtype=torch.uint8)
    for i in range(W.shape[1]):
        if i % group == 0:
            scale, zero = int4_params(W[:, i:i + group], H.diagonal()[i:i + group])
        q, wq = round_column(W[:, i], scale, zero)
        codes[:, i] = q.to(torch.uint8)
        W[:, i + 1:] -= ((W[:, i] - wq) / Hinv[i, i])[:, None] * Hinv[i, i + 1:][None]
        Hinv = Hinv - Hinv[:, i:i + 1] @ Hinv[i:i + 1, :] / Hinv[i, i]  # column i fixed: eliminate it
    return codes


def weight_of(codes, scales, zeros, group, perm=None):
    """The (N, K) weight GPTQ's codes stand for, in input order."""
    sz = torch.stack([scales, zeros], dim=-1).transpose(0, 1)  # (K/G, N, 2)
    w = dequantize_int4(codes, sz.float()).double()
    return w if perm is None else unpermute_columns(w, perm)


@pytest.mark.parametrize("group,block", [(32, 32), (32, 128), (64, 128), (128, 128)])
def test_blocked_gptq_equals_direct_reference(group, block):
    w, x = layer()
    H = x.t() @ x
    codes, scales, zeros, perm = gptq_solve(w, H, group, block=block)
    assert perm is None
    want = gptq_reference(w, H, group)
    assert (codes != want).float().mean() <= 1e-3  # float64: equal but for a rounding tie or two


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_reduces_output_error_against_rtn(group, act_order):
    w, x = layer(seed=group + act_order)
    w, x = w.float(), x.float()
    codes, scales, zeros, perm = gptq_solve(w, x.t() @ x, group, act_order=act_order)
    assert (perm is not None) == act_order
    if act_order:  # the columns of the largest inputs first
        assert torch.equal(perm, torch.argsort((x * x).sum(0), descending=True))
    err_gptq = (x @ (weight_of(codes, scales, zeros, group, perm).float() - w).t()).pow(2).sum()
    err_rtn = (x @ (rtn_weight(w, group) - w).t()).pow(2).sum()
    assert err_gptq < 0.7 * err_rtn


def test_act_order_dead_columns_go_last():
    """K's zero padding has zero inputs: with act-order those columns stay at the end, so the order of the real
    inputs is a permutation of them (Int4Linear.in_perm)."""
    w, x = layer(k=96)
    x[:, 5] = 0  # a real input that is always zero
    H = torch.nn.functional.pad(x.t() @ x, (0, 32, 0, 32))
    _, _, _, perm = gptq_solve(torch.nn.functional.pad(w, (0, 32)), H, 32, act_order=True)
    assert sorted(perm[:96].tolist()) == list(range(96)) and perm[95] == 5


def mha_llama():
    import transformers
    from tiny_models import hf_to_ours

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=160, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                   initializer_range=0.1, pad_token_id=None)
    return hf_to_ours(transformers.LlamaForCausalLM(cfg).eval())


@pytest.mark.parametrize("name", ["llama-gqa", "mha", "gemma2", "qwen2"])
def test_awq_scaling_leaves_float_logits_unchanged(name):
    from tiny_models import hf_to_ours, make_hf

    model = mha_llama() if name == "mha" else hf_to_ours(make_hf(name))
    tokens = torch.randint(0, 160, (1, 40), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(40)
    want = model(tokens, pos, all_logits=True)
    folded = copy.deepcopy(model)
    x, cos, sin, mask = folded.inputs(tokens, pos, None)
    for block in folded.layers:
        linears = [m for m in block.modules() if isinstance(m, torch.nn.Linear)]
        awq_fold(block, input_stats(block, linears, [(x, pos, cos, sin, mask)]), 32)
        x = block(x, pos, cos, sin, mask, None)
    changed = folded.layers[0].input_layernorm.weight - model.layers[0].input_layernorm.weight
    assert changed.abs().max() > 1e-3  # the scales are not all 1
    got = folded(tokens, pos, all_logits=True)
    assert (got - want).abs().max() <= 1e-5


@pytest.mark.parametrize("group", [32, 128])
def test_awq_scale_reduces_output_error_against_rtn(group):
    """With a few large input channels (as a model's), AWQ's searched scales make round-to-nearest's output error on
    the calibration inputs smaller than with none (alpha 0, which the grid holds)."""
    w, x = layer(seed=group)
    w, x = w.float(), x.float()
    s = awq_scale(w, x.t() @ x, x.abs().mean(0), group)
    assert not torch.equal(s, torch.ones_like(s))
    err_awq = (x @ (rtn_weight(w * s, group) / s - w).t()).pow(2).sum()
    err_rtn = (x @ (rtn_weight(w, group) - w).t()).pow(2).sum()
    assert err_awq < 0.9 * err_rtn


def test_learned_rounding_starts_at_round_to_nearest():
    """With no offset and no shrink, learned rounding's grid is round-to-nearest's (up to the bf16 rounding of the
    scales and zeros, which training leaves out), and its gradient reaches the offsets and the shrinks."""
    w, _ = layer(seed=3, dtype=torch.float32)
    N, K = w.shape
    offset = torch.zeros(N, K // 32, 32, requires_grad=True)
    lo, hi = (torch.ones(N, K // 32, 1, requires_grad=True) for _ in range(2))
    with torch.enable_grad():  # conftest turns it off
        got, codes, scale, zero = learned_int4(w, offset, lo, hi, 32)
        got.pow(2).sum().backward()
    assert codes.shape == (N, K // 32, 32) and scale.shape == zero.shape == (N, K // 32, 1)
    want_codes, sz = quantize_int4(w, 32, torch.float32)  # float32 scales: no bf16 rounding either
    assert (codes.flatten(1) == want_codes).all()
    assert torch.allclose(got, dequantize_int4(want_codes, sz), atol=1e-5)
    bf16_codes, _ = quantize_int4(w, 32, torch.bfloat16)
    assert (codes.flatten(1) == bf16_codes).float().mean() > 0.97  # what the stored bf16 scales change
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (offset, lo, hi))


def test_learned_rounding_reduces_block_error(tiny):
    """learn_rounding's codes give a smaller block output error on its calibration inputs than its starting point
    (round-to-nearest on the same grid, 0 steps)."""
    gen = torch.Generator().manual_seed(5)
    block = copy.deepcopy(tiny.layers[0])
    states = []
    for _ in range(4):
        tokens, pos = torch.randint(0, 160, (1, 48), generator=gen), torch.arange(48)
        states.append((tiny.inputs(tokens, pos, None)[0], pos, *tiny.inputs(tokens, pos, None)[1:]))
    targets = [block(*s, None) for s in states]
    linears = {name: m for name, m in block.named_modules() if isinstance(m, torch.nn.Linear)}

    def error(steps):
        learned = learn_rounding(block, linears, states, targets, 32, steps=steps)
        weights = {}
        for name, (codes, scales, zeros) in learned.items():
            sz = torch.stack([scales, zeros], dim=-1).transpose(0, 1)
            weights[name + ".weight"] = dequantize_int4(codes, sz)[:, :linears[name].in_features]
        return sum((torch.func.functional_call(block, weights, (*s, None)) - t).pow(2).sum()
                   for s, t in zip(states, targets))

    assert error(100) < 0.8 * error(0)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["gptq", "awq+gptq", "round", "awq+round"])
def test_calibrated_model_closer_than_rtn(tiny, method):
    """On a tiny random model, GPTQ's and learned rounding's int4:64 logits (after AWQ's folded scales too) are closer
    to the float model's than round-to-nearest's, on the calibration sequences."""
    from quantize import quantize_model

    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, 160, (64,), generator=gen).tolist() for _ in range(4)]
    tokens, pos = torch.tensor(seqs), torch.arange(64)
    want = tiny(tokens, pos, all_logits=True)
    rtn = quantize_model(copy.deepcopy(tiny), "int4:64")
    calibrated = quantize_calibrated(copy.deepcopy(tiny), "int4:64", method, seqs)
    assert isinstance(calibrated.layers[1].mlp.down_proj, Int4Linear)
    err = {name: (m(tokens, pos, all_logits=True) - want).pow(2).mean() for name, m in
           (("rtn", rtn), ("cal", calibrated))}
    assert err["cal"] < err["rtn"]


@pytest.mark.slow
@pytest.mark.parametrize("method,act_order", [("awq+round", False), ("gptq", True)])
def test_tune_grid_lowers_kl_with_codes_fixed(tiny, method, act_order):
    """--tune: the grid tuned end to end leaves every code and act-order as rounding chose them, moves the scales and
    zeros and the norms' weights so the next-token KL from the float model on the calibration sequences drops, and
    hands back Int4Linears whose kernel computes their dequantized weight and RMSNorms of the model's dtype; the
    model's own parameters keep their requires_grad."""
    gen = torch.Generator().manual_seed(6)
    seqs = [torch.randint(0, 160, (64,), generator=gen).tolist() for _ in range(4)]
    tokens, pos = torch.tensor(seqs), torch.arange(64)
    want = torch.log_softmax(tiny(tokens, pos, all_logits=True), -1)

    def kl(model):
        got = torch.log_softmax(model(tokens, pos, all_logits=True), -1)
        return (want.exp() * (want - got)).sum(-1).mean()

    plain = quantize_calibrated(copy.deepcopy(tiny), "int4:32", method, seqs, act_order)
    model = copy.deepcopy(tiny)
    model.norm.weight.requires_grad_(True)  # frozen while the grid trains, trainable again after
    tuned = quantize_calibrated(model, "int4:32", method, seqs, act_order, tune=8)
    assert kl(tuned) < 0.9 * kl(plain)
    linears = [(n, m) for n, m in tuned.named_modules() if isinstance(m, Int4Linear)]
    assert len(linears) == 2 * 4  # qkv, o, gate_up, down per block
    moved = 0
    for name, m in linears:
        before = plain.get_submodule(name)
        assert torch.equal(m.codes(), before.codes()) and m.kernel == before.kernel
        assert (m.in_perm is None) == (not act_order) and (m.in_perm is None or torch.equal(m.in_perm, before.in_perm))
        moved += int((m.scales_and_zeros != before.scales_and_zeros).sum())
        x = torch.randn(5, m.in_features, generator=gen)
        torch.testing.assert_close(m(x), x @ m.dequantize().t(), atol=1e-2, rtol=1e-2)  # the kernel's bf16 inputs
    assert moved > 0
    norms = [(n, m) for n, m in tuned.named_modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 2 * 2 + 1
    for name, m in norms:
        assert m.weight.dtype == torch.float32 and not torch.equal(m.weight, plain.get_submodule(name).weight)
    assert [n for n, p in tuned.named_parameters() if p.requires_grad] == ["norm.weight"]


def test_tune_grid_bfloat16(tiny):
    """A bfloat16 model (export's default dtype) tunes as well: its norms train as float32 copies and come back
    bfloat16, moved, its parameters all bfloat16 still, and its KL from the unquantized model on the sequences lower."""
    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, 160, (64,), generator=gen).tolist() for _ in range(4)]
    reference = copy.deepcopy(tiny).to(torch.bfloat16)
    plain = quantize_calibrated(copy.deepcopy(reference), "int4:32", "awq", seqs)
    before = copy.deepcopy(plain.norm.weight)
    tuned = tune_grid(copy.deepcopy(plain), reference, seqs, passes=2, lr=1e-2, norm_lr=1e-2)  # steps past bf16 spacing
    assert all(p.dtype == torch.bfloat16 for n, p in tuned.named_parameters())
    assert not torch.equal(tuned.norm.weight, before)
    tokens, pos = torch.tensor(seqs), torch.arange(64)
    want = torch.log_softmax(reference(tokens, pos, all_logits=True).float(), -1)
    kl = {name: F.kl_div(torch.log_softmax(m(tokens, pos, all_logits=True).float(), -1), want, log_target=True,
                         reduction="batchmean") for name, m in (("plain", plain), ("tuned", tuned))}
    assert kl["tuned"] < kl["plain"]


def test_sampled_sequences(tiny):
    """Self-sampled calibration: enough seq_len sequences for the tokens asked, each from a 4-token window of the
    text, the same for the same seed, another for another; a sharp model's samples follow its argmax."""
    text = list(range(10, 60))
    seqs = sampled_sequences(tiny, text, 70, 24, seed=1, batch=2)
    assert len(seqs) == 3 and all(len(s) == 24 for s in seqs)
    assert all(any(s[:4] == text[i:i + 4] for i in range(len(text) - 3)) for s in seqs)
    assert sampled_sequences(tiny, text, 70, 24, seed=1, batch=2) == seqs != sampled_sequences(tiny, text, 70, 24, 2)
    sharp = copy.deepcopy(tiny)
    sharp.lm_head.weight.data *= 1e4  # temperature 1 on these logits is greedy
    seq = sampled_sequences(sharp, text, 24, 24, seed=3)[0]
    pos = torch.arange(23)
    assert sharp(torch.tensor([seq[:-1]]), pos, all_logits=True)[0, 3:].argmax(-1).tolist() == seq[4:]


def test_act_order_checkpoint_reloads_exactly(tiny_dir, tmp_path):
    from scripts.export import save_quantized
    from formats.hffolder import read_quantization

    model, _ = load_model(tiny_dir, "cpu", torch.float32, quantize="none")
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 160, (48,), generator=gen).tolist() for _ in range(3)]
    quantize_calibrated(model, "int4:32", "gptq", seqs, act_order=True)  # down_proj: K 112 padded to 128
    save_quantized(model, tiny_dir, str(tmp_path / "out"))
    assert read_quantization(str(tmp_path / "out" / "model.safetensors"))["act_order"] == "true"
    loaded, _ = load_model(str(tmp_path / "out"), "cpu", torch.float32)
    for name, m in model.named_modules():
        if isinstance(m, Int4Linear):
            other = loaded.get_submodule(name)
            assert not torch.equal(m.in_perm, torch.arange(m.in_features))
            assert torch.equal(other.in_perm, m.in_perm) and torch.equal(other.dequantize(), m.dequantize())
    tokens, pos = torch.tensor([seqs[0]]), torch.arange(48)
    assert torch.equal(loaded(tokens, pos, all_logits=True), model(tokens, pos, all_logits=True))


def test_refusals(tiny):
    with pytest.raises(ValueError, match="GPTQ, AWQ and learned rounding make int4:G"):
        quantize_calibrated(copy.deepcopy(tiny), "int8", "gptq", [[1, 2, 3]])
    with pytest.raises(ValueError, match="--method gptq2"):
        quantize_calibrated(copy.deepcopy(tiny), "int4:32", "gptq2", [[1, 2, 3]])
    for method in ("awq", "awq+round"):
        with pytest.raises(ValueError, match=re.escape(f"--act-order is GPTQ's; drop it for --method {method}")):
            quantize_calibrated(copy.deepcopy(tiny), "int4:32", method, [[1, 2, 3]], act_order=True)


def test_export_gptq_act_order_folder(tiny_text_dir, tmp_path):
    """export.py --method gptq --act-order --tune 1 writes a folder that loads with the input orders it was solved
    with and the norms' weights tuned."""
    from scripts import export

    out = tmp_path / "gptq"
    assert export.main(["--model", tiny_text_dir, "--mode", "int4:64", "--method", "gptq", "--act-order",
                        "--calibration-tokens", "500", "--sampled-tokens", "100", "--dtype", "float32", "--tune", "1",
                        "--out", str(out)]) == 0
    loaded, _ = load_model(str(out), "cpu", torch.float32)
    qkv = loaded.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Int4Linear) and qkv.group_size == 64
    assert sorted(qkv.in_perm.tolist()) == list(range(64)) and qkv.in_perm.tolist() != list(range(64))
    source, _ = load_model(tiny_text_dir, "cpu", torch.float32, quantize="none")
    assert not torch.equal(loaded.norm.weight, source.norm.weight)  # GPTQ folds nothing into it: --tune moved it


@pytest.mark.parametrize("argv,message", [
    (["--mode", "int8", "--method", "gptq"], "--method gptq makes the block linears int4:G"),
    (["--mode", "int4:32", "--method", "awq", "--quantize-head"], "the head takes --method rtn"),
    (["--mode", "int4:32", "--act-order"], "need a calibrated --method"),
    (["--mode", "int4:32", "--sampled-tokens", "64"], "need a calibrated --method"),
    (["--mode", "int4:32", "--method", "gptq", "--sampled-tokens", "-1"], "--sampled-tokens must be >= 0"),
    (["--mode", "int4:32", "--tune", "1"], "need a calibrated --method"),
    (["--mode", "int4:32", "--method", "awq", "--tune", "-1"], "--tune must be >= 0"),
    (["--mode", "int4:32", "--method", "gptq", "--calibration-tokens", "1"], "--calibration-tokens must be >= 2")])
def test_export_method_flags_checked_first(tiny_text_dir, tmp_path, cli_error, argv, message):
    from scripts import export

    assert message in cli_error(export.main, ["--model", tiny_text_dir, *argv, "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()
