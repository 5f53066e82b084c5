"""Tensor parallelism on CPU with gloo: N processes, each loading only its slices, against one process."""
import copy
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import quantize as q
from features import tp
from formats.checkpoint import checkpoint_shapes
from helpers import run_py
from load import load_model
from model import ModelArgs
from tiny_models import greedy_ids

PROMPT = [5, 17, 42, 99, 3, 64, 8]
N_NEW = 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(rank: int, world: int, port: int, model_dir: str, out_dir: str, quantize: str | None) -> None:
    """One rank: load its shard, then all-logits of PROMPT and a greedy continuation, saved for the parent."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, _ = load_model(model_dir, "cpu", torch.float32, quantize=quantize, shard=tp.Shard(rank, world))
        tp.install(model)
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT]), torch.arange(len(PROMPT)), all_logits=True)[0]
            tokens = greedy_ids(model, PROMPT, N_NEW)
        local_shapes = checkpoint_shapes(model)  # under the checkpoint's names: q/k/v apart
        torch.save({"logits": logits, "tokens": tokens, "shapes": local_shapes},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.barrier()  # no rank tears gloo down while a peer still talks to it (a rare SIGABRT in CI)
        dist.destroy_process_group()


def run_tp(world: int, model_dir: str, out_dir: str, quantize: str | None = None) -> list[dict]:
    mp.spawn(run_rank, args=(world, free_port(), model_dir, out_dir, quantize), nprocs=world)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


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
    assert shard.region("layers.0.self_attn.q_proj.weight", full) == (0, 32, 64)
    assert shard.region("layers.0.self_attn.k_proj.weight", full) == (0, 0, 16)  # ranks 0, 1 share kv head 0
    assert tp.Shard(2, 4).region("layers.0.self_attn.v_proj.weight", full) == (0, 16, 32)
    assert shard.region("layers.0.self_attn.o_proj.weight", full) == (1, 32, 64)
    assert shard.region("layers.0.mlp.down_proj.weight", full) == (1, 24, 48)
    assert shard.region("embed_tokens.weight", full) is None
    with pytest.raises(ValueError, match="8 attention heads do not divide over 3 ranks"):
        tp.Shard(0, 3).args(full)
    with pytest.raises(ValueError, match="3 kv heads can be neither split nor replicated over 2 ranks"):
        tp.Shard(0, 2).args(ModelArgs(vocab_size=10, dim=64, n_layers=1, n_heads=6, n_kv_heads=3, hidden_dim=96))


@pytest.mark.slow
def test_torchrun_smollm2_matches_one_process(smollm2_gguf):
    """`torchrun --nproc-per-node 3 generate.py` (SmolLM2: 9 heads, 3 kv heads, 3 ranks): the same greedy text."""
    cmd = ["generate.py", "--model", smollm2_gguf, "--prompt", "The capital of France is", "--temperature", "0",
           "--max-new-tokens", "16", "--quiet"]
    one = run_py(*cmd)
    assert one.returncode == 0, one.stderr
    three = run_py("-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port", str(free_port()), *cmd)
    assert three.returncode == 0, three.stderr
    assert three.stdout == one.stdout and one.stdout.strip()
