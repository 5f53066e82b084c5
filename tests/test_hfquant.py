"""GPTQ and AWQ checkpoints (hfquant.py): folders packed here from random weights following each format's published
layout (AutoGPTQ's / gptqmodel's qweight, qzeros, scales, g_idx; AutoAWQ's gemm order) load into Int4Linear with
their codes as they are, and run as the dequantized float model within the kernel's rounding."""
import json

import pytest
import torch

from formats.hfquant import AWQ_ORDER
from load import load_model
from quantize import Int4Linear

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_llama(tmp_path):
    """A random tiny Llama saved by transformers (hidden 64, MLP 128: every K a multiple of the groups below)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   initializer_range=0.1, pad_token_id=None)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "float")
    return json.loads((tmp_path / "float" / "config.json").read_text()), model.state_dict()


def rtn(w: torch.Tensor, g_idx: torch.Tensor, groups: int):
    """Asymmetric round-to-nearest of w (N, K) with the groups g_idx gives the inputs: q (N, K), z and s
    (groups, N) as GPTQ/AWQ store them (z an integer in [0, 15], s float16)."""
    members = [w[:, g_idx == g] for g in range(groups)]
    lo = torch.stack([m.amin(1) for m in members]).clamp(max=0)  # (groups, N)
    hi = torch.stack([m.amax(1) for m in members]).clamp(min=0)
    s = ((hi - lo) / 15).clamp(min=1e-4).half()
    z = torch.round(-lo / s.float()).clamp(0, 15).int()
    q = torch.round(w / s.float()[g_idx].t() + z[g_idx].t()).clamp(0, 15).int()  # (N, K)
    return q, z, s


def pack_nibbles(v: torch.Tensor) -> torch.Tensor:
    """(R, 8C) ints in [0, 15] -> (R, C) int32, element 8c + j in bits 4j..4j+3."""
    v = v.long().view(v.shape[0], -1, 8)
    packed = sum(v[:, :, j] << (4 * j) for j in range(8))  # (R, C), up to 2^32 - 1
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).int()


def pack_linear(w, method, group, perm, v2):
    """One linear as the checkpoint stores it, and the float weight that stands for; perm: the act order."""
    N, K = w.shape
    g_idx = torch.empty(K, dtype=torch.int32)
    g_idx[perm] = (torch.arange(K) // group).int()  # the i-th input in act order is in group i // G
    q, z, s = rtn(w, g_idx.long(), K // group)
    w_float = (q - z[g_idx.long()].t()).float() * s.float()[g_idx.long()].t()  # (N, K)
    if method == "gptq":
        packed = {"qweight": pack_nibbles(q).t().contiguous(),  # (K/8, N): 8 inputs of a column per int32
                  "qzeros": pack_nibbles(z - (0 if v2 else 1)), "scales": s, "g_idx": g_idx}
    else:  # AutoAWQ gemm: nibble j of an int32 holds column 8i + AWQ_ORDER[j]
        order = (torch.arange(N).view(-1, 8)[:, list(AWQ_ORDER)]).reshape(-1)
        packed = {"qweight": pack_nibbles(q.t()[:, order]), "qzeros": pack_nibbles(z[:, order]), "scales": s}
    return packed, w_float


def write_folders(tmp_path, method, group, act_order=False, v2=False, bits=4):
    """(packed folder, float folder holding the dequantized weights)."""
    from safetensors.torch import save_file

    cfg, state = tiny_llama(tmp_path)
    gen = torch.Generator().manual_seed(1)
    packed, floats, perms = {}, {}, {}
    for key, t in state.items():
        if key == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        if key.rsplit(".", 2)[-2] in LINEARS:
            prefix = key.removesuffix(".weight")
            # GPTQ's act order comes from the input's Hessian: q/k/v share theirs, and gate/up
            shared = prefix.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
            K = t.shape[1]
            perm = perms.setdefault(shared, torch.randperm(K, generator=gen) if act_order else torch.arange(K))
            tensors, floats[key] = pack_linear(t, method, group, perm, v2)
            packed.update({f"{prefix}.{k}": v for k, v in tensors.items()})
        else:
            packed[key] = floats[key] = t.contiguous()
    quant = {"quant_method": method, "bits": bits, "group_size": group}
    quant.update({"desc_act": act_order, "sym": False, "checkpoint_format": "gptq_v2" if v2 else "gptq"}
                 if method == "gptq" else {"version": "gemm", "zero_point": True})
    for name, tensors, config in (("packed", packed, {**cfg, "quantization_config": quant}), ("deq", floats, cfg)):
        (tmp_path / name).mkdir()
        save_file(tensors, str(tmp_path / name / "model.safetensors"))
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    return str(tmp_path / "packed"), str(tmp_path / "deq")


@pytest.mark.parametrize("method,group,act_order,v2", [
    ("gptq", 32, False, False), ("gptq", 32, True, False), ("gptq", 64, True, True), ("gptq", -1, False, True),
    ("awq", 32, False, False), ("awq", 64, False, False)])
def test_packed_checkpoint_runs_as_its_dequantized_weights(tmp_path, method, group, act_order, v2):
    packed, deq = write_folders(tmp_path, method, 64 if group == -1 else group, act_order, v2)
    if group == -1:  # per channel: the same codes with one group per row
        cfg = json.loads((tmp_path / "packed" / "config.json").read_text())
        cfg["quantization_config"]["group_size"] = -1
        (tmp_path / "packed" / "config.json").write_text(json.dumps(cfg))
    quant, _ = load_model(packed, "cpu", torch.float32)
    ref, _ = load_model(deq, "cpu", torch.float32)
    linears = {n: m for n, m in quant.named_modules() if isinstance(m, Int4Linear)}
    assert len(linears) == 8 and all((m.in_perm is not None) == act_order for m in linears.values())
    floats = dict(ref.named_modules())
    for name, m in linears.items():  # the codes as stored: the only rounding is scale and zero to bf16
        w, w_ref = m.dequantize(), floats[name].weight
        assert (w - w_ref).abs().max() <= 2 ** -7 * w_ref.abs().max(), name
    tokens = torch.randint(0, 160, (1, 24), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(24)
    got, want = quant(tokens, pos, all_logits=True), ref(tokens, pos, all_logits=True)
    assert (got - want).abs().max() <= 0.02 * want.abs().max()  # bf16 activations, scales and zeros


def test_act_order_permutation_is_needed_and_applied(tmp_path):
    """Act-order codes reorder the inputs: the kernel gathers x's columns, the reference path the weight's; a model
    loaded with the permutation dropped is far off (so the test above sees it)."""
    packed, deq = write_folders(tmp_path, "gptq", 32, act_order=True)
    quant, _ = load_model(packed, "cpu", torch.float32)
    ref, _ = load_model(deq, "cpu", torch.float32)
    tokens, pos = torch.randint(0, 160, (1, 16), generator=torch.Generator().manual_seed(3)), torch.arange(16)
    want = ref(tokens, pos, all_logits=True)
    for m in quant.modules():
        if isinstance(m, Int4Linear):
            assert not torch.equal(m.in_perm, torch.arange(m.in_features))
            m.in_perm = torch.arange(m.in_features)
    assert (quant(tokens, pos, all_logits=True) - want).abs().max() > 0.1 * want.abs().max()


@pytest.mark.parametrize("change,message", [
    ({"bits": 3}, "3-bit codes; only 4-bit"), ({"bits": 2}, "2-bit codes; only 4-bit"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
    ({"group_size": 48}, "group size 48 is not a multiple of any int4 kernel group size"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'")])
def test_what_cannot_load_without_rounding_is_refused(tmp_path, change, message):
    packed, _ = write_folders(tmp_path, "gptq", 32)
    cfg = json.loads((tmp_path / "packed" / "config.json").read_text())
    cfg["quantization_config"].update(change)
    (tmp_path / "packed" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        load_model(packed, "cpu", torch.float32)


def test_awq_gemv_and_requantizing_refused(tmp_path):
    packed, _ = write_folders(tmp_path, "awq", 32)
    with pytest.raises(ValueError, match="loads as its own codes"):
        load_model(packed, "cpu", torch.float32, quantize="int8")
    cfg = json.loads((tmp_path / "packed" / "config.json").read_text())
    cfg["quantization_config"]["version"] = "gemv"
    (tmp_path / "packed" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="only the gemm layout"):
        load_model(packed, "cpu", torch.float32)


@pytest.mark.parametrize("n,k,group", [(48, 64, 32), (20, 96, 32), (32, 256, 128)])
def test_act_order_kernel_equals_reference(n, k, group):
    """Int4Linear with an input order: the kernel path (x's columns gathered) equals x @ dequantize()^T (the
    weight's columns put back), and dequantize() is the codes' weight in input order."""
    gen = torch.Generator().manual_seed(n + k)
    m = Int4Linear(k, n, group, act_order=True)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales, zeros = torch.rand(n, k // group, generator=gen) / 10, torch.randn(n, k // group, generator=gen) / 10
    perm = torch.randperm(k, generator=gen)
    m.load_part(0, m.buffers_for_codes(codes, scales, zeros, perm))
    m.pack_for_kernel()
    assert m.kernel == "cpu"
    w = m.dequantize()
    bf = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
    w_codes = (codes.float() - 8) * bf(scales).repeat_interleave(group, 1) + bf(zeros).repeat_interleave(group, 1)
    assert torch.equal(w[:, perm], w_codes)
    x = torch.randn(5, k, generator=gen).to(torch.bfloat16).float()
    assert torch.allclose(m(x), x @ w.t(), rtol=2e-2, atol=2e-2)
