"""Tensor parallelism on CPU with gloo: N processes, each loading only its slices, against one process; a GGUF's
int4 codes sliced as codes."""
import copy
import os
import re
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import quantize as q
from features import tp
from formats.checkpoint import checkpoint_modules, checkpoint_shapes
from helpers import rank_device, run_py
from load import load_model
from model import ModelArgs
from tiny_models import greedy_ids, write_llama_gguf

PROMPT = [5, 17, 42, 99, 3, 64, 8]
N_NEW = 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(rank: int, world: int, port: int, model_dir: str, out_dir: str, quantize: str | None,
             device: str = "cpu") -> None:
    """One rank: load its shard, then all-logits of PROMPT and a greedy continuation, saved for the parent."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    device = rank_device(rank, device)
    try:
        model, _ = load_model(model_dir, device, torch.float32, quantize=quantize, shard=tp.Shard(rank, world))
        tp.install(model)
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT], device=device), torch.arange(len(PROMPT), device=device),
                           all_logits=True)[0]
            tokens = greedy_ids(model, PROMPT, N_NEW)
        local_shapes = checkpoint_shapes(model)  # under the checkpoint's names: q/k/v apart
        torch.save({"logits": logits.cpu(), "tokens": tokens, "shapes": local_shapes, "label": q.describe(model),
                    "bytes": q.weight_bytes(model)}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.barrier()  # no rank tears gloo down while a peer still talks to it (a rare SIGABRT in CI)
        dist.destroy_process_group()


def run_tp(world: int, model_dir: str, out_dir: str, quantize: str | None = None, device: str = "cpu") -> list[dict]:
    mp.spawn(run_rank, args=(world, free_port(), model_dir, out_dir, quantize, device), nprocs=world)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


def tiny_gguf(path, heads: int, kv_heads: int, head_dim: int, hidden: int, intermediate: int,
              tied: bool = True) -> str:
    """A random 2-layer llama written as SmolLM2's file is: Q4_1 block linears, a Q8_0 embedding tied to the head
    (vocabulary 160); untied, a Q8_0 `output` and a float32 embedding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=160, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.1,
                         tie_word_embeddings=tied)
    return write_llama_gguf(path, LlamaForCausalLM(config).eval(), "Q4_1", {"token_embd" if tied else "output": "Q8_0"})


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory) -> str:
    """SmolLM2's shape in small: 6 heads in 3 kv groups of head dim 32, MLP 192 (6 groups of 32)."""
    return tiny_gguf(tmp_path_factory.mktemp("tp") / "q4.gguf", 6, 3, 32, 96, 192)


def code_weights(model) -> dict[str, torch.Tensor]:
    """Each checkpoint linear's (N, K) weight dequantized from its int4 codes (q/k/v, gate/up apart)."""
    out = {}
    for name, (module_name, part) in checkpoint_modules(model).items():
        module = model.get_submodule(module_name)
        assert isinstance(module, q.Int4Linear) or not name.endswith("_proj"), f"{name}: {module}"
        if isinstance(module, q.Int4Linear):
            start, n = module.part_rows(part)
            out[name + ".weight"] = module.dequantize()[start:start + n]
    return out


@pytest.fixture(scope="module")
def single(tiny_dir):
    """llama-gqa (4 query heads, 2 kv heads of dim 24, MLP width 112) in one process: logits and greedy tokens."""
    model, _ = load_model(tiny_dir, "cpu", torch.float32)
    logits = model(torch.tensor([PROMPT]), torch.arange(len(PROMPT)), all_logits=True)[0]
    return model, logits, greedy_ids(model, PROMPT, N_NEW)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])  # 2: the 2 kv heads split; 4: each kv head replicated on 2 ranks
def test_tp_logits_and_greedy_match_one_process(tiny_dir, single, tmp_path, world):
    _, logits, tokens = single
    ranks = run_tp(world, tiny_dir, str(tmp_path))
    for r in ranks:
        assert (r["logits"] - logits).abs().max() <= 1e-4
        assert r["tokens"] == tokens
    # each rank holds only its slices: q_proj 4/world heads of 24, k/v max(2/world, 1) heads, MLP 112/world
    shapes = ranks[0]["shapes"]
    assert shapes["layers.0.self_attn.q_proj.weight"] == (4 // world * 24, 64)
    assert shapes["layers.0.self_attn.k_proj.weight"] == (max(2 // world, 1) * 24, 64)
    assert shapes["layers.0.self_attn.o_proj.weight"] == (64, 4 // world * 24)
    assert shapes["layers.0.mlp.down_proj.weight"] == (64, 112 // world)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs (scripts/gpu_check.sh runs it)")
def test_tp_over_nccl_matches_one_process(tiny_dir, single, tmp_path):
    """The same split on two GPUs, all-reduces and the vocabulary's all-gather over NCCL."""
    _, logits, tokens = single
    for r in run_tp(2, tiny_dir, str(tmp_path), device="cuda"):
        assert (r["logits"] - logits).abs().max() <= 1e-4
        assert r["tokens"] == tokens


@pytest.mark.slow
def test_tp_int8(tiny_dir, single, tmp_path):
    """int8 shards: per-channel scales of a row-parallel slice cover fewer columns than the full row's, so the
    result is not bit-equal to one process's int8 model, but as close to the float model."""
    model, logits, _ = single
    one = q.quantize_model(copy.deepcopy(model), "int8")
    one_err = (one(torch.tensor([PROMPT]), torch.arange(len(PROMPT)), all_logits=True)[0] - logits).abs().max()
    ranks = run_tp(2, tiny_dir, str(tmp_path), quantize="int8")
    assert torch.equal(ranks[0]["logits"], ranks[1]["logits"])
    assert (ranks[0]["logits"] - logits).abs().max() <= 2 * one_err + 1e-3


def test_shard_slices_and_errors():
    full = ModelArgs(vocab_size=10, dim=64, n_layers=1, n_heads=8, n_kv_heads=2, hidden_dim=96, head_dim=16)
    shard = tp.Shard(1, 4)
    local = shard.args(full)
    assert (local.n_heads, local.n_kv_heads, local.hidden_dim, local.head_dim) == (2, 1, 24, 16)
    assert local.vocab_size == 10  # the logits are gathered whole
    assert shard.region("layers.0.self_attn.q_proj.weight", full) == (0, 32, 64)
    assert shard.region("layers.0.self_attn.k_proj.weight", full) == (0, 0, 16)  # ranks 0, 1 share kv head 0
    assert tp.Shard(2, 4).region("layers.0.self_attn.v_proj.weight", full) == (0, 16, 32)
    assert shard.region("layers.0.self_attn.o_proj.weight", full) == (1, 32, 64)
    assert shard.region("layers.0.mlp.down_proj.weight", full) == (1, 24, 48)  # 3 groups of 32 for 4 ranks: by unit
    assert shard.region("embed_tokens.weight", full) == (0, 3, 6)  # ceil(10/4) rows each, the last rank 1
    assert tp.Shard(3, 4).region("lm_head.weight", full) == (0, 9, 10)
    assert shard.region("layers.0.input_layernorm.weight", full) is None
    with pytest.raises(ValueError, match="2 kv heads can be neither split nor replicated over 3 ranks"):
        tp.Shard(0, 3).args(full)
    with pytest.raises(ValueError, match="6 attention heads do not divide over 4 ranks"):
        tp.Shard(0, 4).args(ModelArgs(vocab_size=10, dim=64, n_layers=1, n_heads=6, n_kv_heads=1, hidden_dim=96))


def test_uneven_splits_take_whole_kv_groups_and_even_out_the_weights():
    """SmolLM2's 9 heads in 3 kv groups over 2 ranks: 6 and 3 heads (2 and 1 groups), so the second rank takes more
    of the MLP (864 units of 1536 against 672, in groups of 32) and the ranks' block weights come out within 3%.
    Even heads split the MLP evenly (512 each over 3 ranks; 320, 320, 320, 288, 288 over 5). Each is a partition."""
    full = ModelArgs(vocab_size=49152, dim=576, n_layers=1, n_heads=9, n_kv_heads=3, hidden_dim=1536)
    assert [tp.Shard(r, 2).heads(full) for r in range(2)] == [(0, 6, 0, 2), (6, 3, 2, 1)]
    assert tp.Shard(1, 2).region("layers.0.self_attn.o_proj.weight", full) == (1, 384, 576)
    assert [tp.Shard(r, 2).mlp(full) for r in range(2)] == [(0, 672), (672, 1536)]
    block = [2 * (nq + nk) * 64 + 3 * (b - a) for (_, nq, _, nk), (a, b) in
             ((tp.Shard(r, 2).heads(full), tp.Shard(r, 2).mlp(full)) for r in range(2))]  # weights per model dim
    assert abs(block[0] - block[1]) <= 0.03 * sum(block) / 2  # 3040 and 3104: a group of 32 units is 96
    assert [tp.Shard(r, 3).heads(full) for r in range(3)] == [(3 * r, 3, r, 1) for r in range(3)]
    five = ModelArgs(vocab_size=49152, dim=640, n_layers=1, n_heads=10, n_kv_heads=5, hidden_dim=1536)
    for args, world, widths in ((full, 3, [512] * 3), (five, 5, [320] * 3 + [288] * 2)):
        mlp = [tp.Shard(r, world).mlp(args) for r in range(world)]
        assert [b - a for a, b in mlp] == widths and all(a % 32 == 0 for a, _ in mlp)
        assert [a for a, _ in mlp[1:]] == [b for _, b in mlp[:-1]] and mlp[-1][1] == 1536
    assert tp.spans(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert tp.balanced(7, [0.0, 0.0, 0.0]) == [3, 2, 2] and tp.balanced(6, [2.0, 0.0]) == [2, 4]
    assert tp.balanced(2, [5.0, 0.0]) == [1, 1]  # no rank left without units: spans()


@pytest.mark.parametrize("world,tied", [(2, True), (3, True), (2, False)])
def test_each_rank_holds_its_slice_of_the_files_codes(q4_gguf, tmp_path, world, tied):
    """Loading a Q4_1 / Q8_0 file's shard keeps the codes: every rank's block linears are int4 whose weights are
    exactly its slice of one process's (rows of q/k/v/gate/up, columns of o_proj/down_proj cut between groups),
    its head the Q8_0 codes of its vocabulary rows, its embedding those rows; and its weight bytes about 1/world."""
    path = q4_gguf if tied else tiny_gguf(tmp_path / "untied.gguf", 6, 3, 32, 96, 192, tied=False)
    one, _ = load_model(path, "cpu", torch.float32)
    whole, whole_bytes, held = code_weights(one), q.weight_bytes(one), []
    for r in range(world):
        shard = tp.Shard(r, world)
        model, _ = load_model(path, "cpu", torch.float32, shard=shard)
        assert q.describe(model) == q.describe(one) == "int4:32 (+head int8:32)"
        mine = code_weights(model)
        assert mine.keys() == whole.keys()
        for name, w in mine.items():
            dim, start, stop = shard.region(name, one.args)
            assert torch.equal(w, whole[name].narrow(dim, start, stop - start)), name
        start, stop = shard.vocab(one.args)
        assert torch.equal(model.lm_head.dequantize(), one.lm_head.dequantize()[start:stop])
        assert torch.equal(model.embed_tokens.weight, one.embed_tokens.weight[start:stop])
        held.append(q.weight_bytes(model))
    # each rank about 1/world of the bytes (the embedding and head too: 37% of them; 2 ranks hold 4 and 2 of the 6
    # heads, and 64 and 128 MLP units); the sum is one process's, plus the replicated norms and padding
    assert all(abs(b - whole_bytes / world) <= 0.1 * whole_bytes / world for b in held), (held, whole_bytes)
    assert whole_bytes <= sum(held) <= 1.05 * whole_bytes


def test_a_cut_inside_a_quantization_group_is_refused(tmp_path):
    """4 heads of dim 16 over 4 ranks: o_proj's 64 columns would be cut every 16, inside Q4_1's groups of 32, so
    the codes cannot be sliced as they are: a ValueError naming the shapes; dequantized, the split loads."""
    path = tiny_gguf(tmp_path / "d16.gguf", 4, 4, 16, 64, 128)
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.o_proj\.weight \(64, 64\) holds quantized codes "
                                         r"in groups of 32 columns, and rank 0 of 4 takes columns 0:16, which cuts"):
        load_model(path, "cpu", torch.float32, shard=tp.Shard(0, 4))
    model, _ = load_model(path, "cpu", torch.float32, quantize="none", shard=tp.Shard(0, 4))
    assert model.layers[0].self_attn.o_proj.weight.shape == (64, 16)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])  # 2: kv groups 2 + 1 (heads 4 + 2); 3: one group each, vocabulary 54/54/52
def test_tp_on_the_files_codes_matches_one_process(q4_gguf, tmp_path, world):
    """gloo ranks on the sliced codes give one process's int4 tokens, and its logits but for bf16 rounding: the
    int4 kernel takes and returns bf16, so each rank's partial sum of o_proj / down_proj is rounded before the
    all-reduce adds them, where one process rounds the whole sum once."""
    one, _ = load_model(q4_gguf, "cpu", torch.float32)
    logits = one(torch.tensor([PROMPT]), torch.arange(len(PROMPT)), all_logits=True)[0]
    tokens = greedy_ids(one, PROMPT, N_NEW)
    for r in run_tp(world, q4_gguf, str(tmp_path)):
        assert r["label"] == "int4:32 (+head int8:32)"
        assert (r["logits"] - logits).abs().max() <= 2 ** -6 * logits.abs().max()  # a few bf16 units (2^-8)
        assert r["tokens"] == tokens


def weights_mb(summary: str) -> list[float]:
    """The weight megabytes a summary line reports: one process's, or each rank's (`weights per rank A + B MB`)."""
    found = re.search(r"weights (?:per rank )?([\d.]+(?: \+ [\d.]+)*) MB", summary)
    assert found, summary
    return [float(x) for x in found[1].split(" + ")]


@pytest.mark.slow
@pytest.mark.parametrize("world,quantize", [(2, None), (3, None), (3, "none")])
def test_torchrun_smollm2_matches_one_process(smollm2_gguf, smollm2_one_process, world, quantize):
    """`torchrun --nproc-per-node N generate.py` on SmolLM2 (9 heads in 3 kv groups; 2 ranks take 6 and 3): one
    process's greedy text, on the file's int4 codes (default) or dequantized; each rank's weight bytes, as rank 0's
    summary line reports them, within 10% of 1/N of one process's."""
    cmd, one_process = smollm2_one_process
    one = one_process(quantize)
    want, one_mb = one.stdout, weights_mb(one.stderr)[0]
    extra = [] if quantize is None else ["--quantize", quantize]
    got = run_py("-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port", str(free_port()),
                 *cmd, "--model", smollm2_gguf, *extra, timeout=600)
    assert got.returncode == 0, got.stderr
    assert got.stdout == want and want.strip()
    per_rank = weights_mb(got.stderr)
    assert len(per_rank) == world and f"tensor parallel x{world}" in got.stderr
    assert all(abs(mb - one_mb / world) <= 0.1 * one_mb / world for mb in per_rank), (per_rank, one_mb)
    assert ("int4:32 (+head int8:32)" in got.stderr) == (quantize is None)
