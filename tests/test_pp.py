"""Pipeline parallelism on CPU with gloo: P processes, each holding a range of the layers, against one process: the
logits, greedy tokens, a batch's rows in micro-batches, and the serving engine on rank 0 with the others' layers."""
import os
import re
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import generate as generate_cli
from decode import generate_batch
from features import pp, tp
from helpers import ROOT, ToyTokenizer, rank_device, run_py
from kvcache import BlockPool, Int8LayerKVCache, KVCache, PagedKVCache
from load import load_model
from model import ModelArgs
from serving.engine import Engine, EngineConfig
from step import Step
from tiny_models import greedy_ids, make_hf

PROMPT = [5, 17, 42, 99, 3, 64, 8]
N_NEW = 16
ROWS = [PROMPT, PROMPT[:3], [9, 1, 150, 77, 23, 4, 61, 30, 2, 11], PROMPT[2:]]  # one batch, of different lengths
ENGINE = EngineConfig(block_size=4, num_blocks=120, max_running=8, token_budget=64)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_prompts() -> list[list[int]]:
    """8 prompts, the last four sharing the first four's opening blocks (prefix-cache hits)."""
    g = torch.Generator().manual_seed(0)
    first = [torch.randint(1, 160, (n,), generator=g).tolist() for n in (9, 22, 5, 14)]
    return first + [p[:8] + [3, 1, 4] for p in first[:2]] + [first[1] + [7], first[3][:12]]


def batch_tokens(model, step) -> list[list[int | None]]:
    return [[t.id if t else None for t in row] for row in generate_batch(model, ROWS, max_new_tokens=8, step=step)]


def run_engine(engine) -> list:
    """Two rounds of the 8 prompts (the second from the prefix cache): each completion's tokens and prefilled."""
    return [[(c.tokens, c.prefilled) for c in engine.generate(engine_prompts(), max_new_tokens=10)] for _ in range(2)]


def run_rank(rank: int, world: int, stages: int, port: int, model_dir: str, out_dir: str,
             micros: tuple[int, ...], device: str = "cpu") -> None:
    """One rank of a stage, for each micro-batch count M in turn (one launch, one load): the all-position logits of
    PROMPT, a greedy continuation, a batch of rows of different lengths, and the engine (rank 0; the other ranks
    run serve_stage), saved for the parent."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    device = rank_device(rank, device)
    try:
        stage, group = pp.place(tp.Shard(rank, world), stages)
        model, _ = load_model(model_dir, device, torch.float32, shard=stage.shard())
        if group is not None:  # once: every pipeline below shares the model's modules
            tp.install(model, group)
        for micro in micros:
            out = run_micro(model, stage, micro, rank, device)
            torch.save(out, os.path.join(out_dir, f"rank{rank}-m{micro}.pt"))
    finally:
        dist.barrier()  # no rank tears gloo down while a peer still talks to it
        dist.destroy_process_group()


def run_micro(model, stage, micro: int, rank: int, device) -> dict:
    """run_rank's results for M = micro micro-batches."""
    pipe = pp.split(model, stage, micro)
    step = Step(pipe)
    with torch.inference_mode():
        prompt, pos = torch.tensor([PROMPT], device=device), torch.arange(len(PROMPT), device=device)
        logits = pipe(prompt, pos, all_logits=True)[0]
        cache = KVCache.for_model(pipe.args, 1, 16, torch.float32, device)  # the prompt in micro-batches of tokens
        cached = step(prompt, pos, cache, all_logits=True, prefill=True)
        out = {"logits": logits.cpu(), "cached": cached[0].cpu(), "chunks": len(pipe.parts(prompt, pos, cache)),
               "tokens": greedy_ids(pipe, PROMPT, N_NEW, step=step), "rows": batch_tokens(pipe, step),
               "layers": len(pipe.layers), "first": pipe.first_layer,
               "cache_layers": len(KVCache.for_model(pipe.args, 1, 8, torch.float32, device).layers),
               "kv_heads": pipe.args.n_kv_heads}
    engine_pipe = pp.split(model, stage, micro, to=0)
    engine_step = pp.PipelineStep(Step(engine_pipe)) if rank == 0 else Step(engine_pipe)
    if rank == 0:
        engine = Engine(engine_pipe, ToyTokenizer(), ENGINE, engine_step)
        engine_step.watch(engine.pool)
        out["engine"] = run_engine(engine)
        engine_step.stop()
    else:
        pp.serve_stage(engine_step, BlockPool.for_model(engine_pipe.args, ENGINE.num_blocks, ENGINE.block_size,
                                                        torch.float32, device))
    out["report"] = pipe.report()
    return out


@pytest.fixture(scope="module")
def tiny4_dir(tmp_path_factory) -> str:
    """llama-gqa with 4 layers: enough for 3 stages."""
    path = tmp_path_factory.mktemp("pp") / "llama-gqa-4"
    make_hf("llama-gqa", num_hidden_layers=4).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def single(tiny4_dir):
    """One process: the logits, greedy tokens, batch rows and engine completions the stages must give."""
    model, _ = load_model(tiny4_dir, "cpu", torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT]), torch.arange(len(PROMPT)), all_logits=True)[0]
        return {"logits": logits, "tokens": greedy_ids(model, PROMPT, N_NEW), "rows": batch_tokens(model, Step(model)),
                "engine": run_engine(Engine(model, ToyTokenizer(), ENGINE))}


@pytest.mark.slow
@pytest.mark.parametrize("world,stages,micros", [(2, 2, (1, 2)), (3, 3, (2, 4)), (4, 2, (2,))],
                         ids=["2-2-1+2", "3-3-2+4", "4-2-2"])
def test_stages_give_one_process_logits_tokens_and_engine(tiny4_dir, single, tmp_path, world, stages, micros):
    """P stages with M micro-batches (each M of a launch in turn; and 2 tensor-parallel ranks a stage: 4 processes
    for 2 stages): one process's float32 logits within 1e-5 (uncached, and a cached prefill in M chunks of tokens),
    its greedy tokens, a batch of rows of different lengths (per-row positions, split into micro-batches), and the
    engine's 8 concurrent requests twice, the second round from the prefix cache (fewer tokens prefilled), whose
    forwards run through the stages; each stage holds and caches only its layers (and under tensor parallel its kv
    heads)."""
    mp.spawn(run_rank, args=(world, stages, free_port(), tiny4_dir, str(tmp_path), micros), nprocs=world)
    for micro in micros:
        ranks = [torch.load(os.path.join(tmp_path, f"rank{r}-m{micro}.pt")) for r in range(world)]
        check_stages(single, ranks, world, stages, micro)


def check_stages(single: dict, ranks: list[dict], world: int, stages: int, micro: int) -> None:
    """The ranks' results with M = micro micro-batches against one process's (the test above says what)."""
    for r in ranks:
        assert (r["logits"] - single["logits"]).abs().max() <= 1e-5
        assert (r["cached"] - single["logits"]).abs().max() <= 1e-5 and r["chunks"] == micro
        assert r["tokens"] == single["tokens"]
        assert r["rows"] == single["rows"]
        assert r["cache_layers"] == r["layers"]
    assert ranks[0]["engine"] == single["engine"]
    second = [prefilled for _, prefilled in ranks[0]["engine"][1]]
    assert sum(second) < sum(len(p) for p in engine_prompts())  # the prefix cache served part of the prompts
    heads = [r["kv_heads"] for r in ranks]
    assert heads == [2 // (world // stages)] * world  # llama-gqa's 2 kv heads, split over a stage's ranks
    firsts = [r["first"] for r in ranks[::world // stages]]  # a stage's ranks hold the same layers
    assert firsts == [sum(r["layers"] for r in ranks[:i * world // stages:world // stages]) for i in range(stages)]
    assert sum(r["layers"] for r in ranks[::world // stages]) == 4
    assert f"pipeline x{stages}: bubble" in ranks[0]["report"] and f"x {min(micro, len(ROWS))}" in ranks[0]["report"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs (scripts/gpu_check.sh runs it)")
def test_stages_over_nccl_give_one_process_tokens(tiny4_dir, single, tmp_path):
    """2 stages on two GPUs, the hidden states sent point to point over NCCL: one (CPU) process's logits within
    1e-4, its greedy tokens, batch rows and engine completions."""
    mp.spawn(run_rank, args=(2, 2, free_port(), tiny4_dir, str(tmp_path), (2,), "cuda"), nprocs=2)
    ranks = [torch.load(os.path.join(tmp_path, f"rank{r}-m2.pt")) for r in range(2)]
    for r in ranks:
        assert (r["logits"] - single["logits"]).abs().max() <= 1e-4
        assert r["tokens"] == single["tokens"] and r["rows"] == single["rows"]
    assert ranks[0]["engine"] == single["engine"]


def test_layers_are_balanced_with_the_head_on_the_last_stage():
    """SmolLM2's 30 layers: its head (49152 x 576) reads as much as 8 layers (6144 weights per model dim each), so
    2 stages take 19 and 11 + head; 3 stages 13, 13 and 4 + head. A tiny vocabulary's head counts for little;
    fewer layers than stages is refused."""
    smollm2 = ModelArgs(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, hidden_dim=1536)
    assert pp.layer_cost(smollm2) == 6144
    assert [pp.Stage(r, 2).layers(smollm2) for r in range(2)] == [range(0, 19), range(19, 30)]
    assert [len(pp.Stage(r, 3).layers(smollm2)) for r in range(3)] == [13, 13, 4]
    rank0 = tp.Shard(0, 2).args(smollm2)  # 6 heads and 672 MLP units (rank 1: 3 and 864), half the vocabulary
    assert pp.Stage(0, 2, 0, 2).counts(rank0) == pp.Stage(1, 2, 1, 2).counts(tp.Shard(1, 2).args(smollm2)) == [19, 11]
    tiny = ModelArgs(vocab_size=160, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=112, head_dim=24)
    assert [pp.Stage(r, 3).layers(tiny) for r in range(3)] == [range(0, 2), range(2, 3), range(3, 4)]
    with pytest.raises(ValueError, match="4 layers cannot be split over 5 stages"):
        pp.Stage(0, 5).layers(tiny)


def test_a_micro_batch_sees_its_rows_of_the_cache():
    """rows_of views a layer's cache by rows: a write through the view lands in those rows of the whole cache
    (static, int8 and paged), and the other rows stay untouched."""
    k, v = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4)  # (b, K, T, D)
    pos = torch.arange(3)
    for cache in (KVCache(1, 5, 2, 8, 4, torch.float32, "cpu"), KVCache(1, 5, 2, 8, 4, torch.float32, "cpu", "int8")):
        layer = cache.layers[0]
        view = pp.rows_of(layer, 1, 3)
        kv = view.update(pos, k, v)
        assert kv[0].shape == (2, 2, 8, 4)
        int8 = isinstance(layer, Int8LayerKVCache)
        whole = layer.k * layer.k_scale if int8 else layer.k  # (5, K, S, D)
        assert torch.allclose(whole[1:3, :, :3], k, atol=0.02 if int8 else 0)
        assert not whole[0].any() and not whole[3:].any()
    pool = BlockPool(1, 6, 4, 2, 4, torch.float32, "cpu")
    paged = PagedKVCache(pool, torch.tensor([[1], [2], [3]]))
    pp.rows_of(paged.layers[0], 1, 3).update(pos, k, v)
    assert torch.equal(pool.k[0][2:4, :, :3], k) and not pool.k[0][1].any()


def test_pipeline_flags_are_checked(monkeypatch):
    """--pipeline-parallel runs under torchrun with P x N processes (N tensor-parallel ranks a stage), eagerly;
    --micro-batches needs it."""
    def check(*flags: str) -> None:
        generate_cli.check_args(generate_cli.parse_args(["--prompt", "x", *flags]))

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="--micro-batches needs --pipeline-parallel"):
        check("--micro-batches", "2")
    with pytest.raises(ValueError, match="launch it with torchrun --nproc-per-node 2"):
        check("--pipeline-parallel", "2")
    with pytest.raises(ValueError, match="runs eagerly; it cannot take --compile full"):
        check("--pipeline-parallel", "2", "--compile", "full")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"needs a multiple of 2 processes \(P stages x N tensor-parallel ranks "):
        check("--pipeline-parallel", "2")
    with pytest.raises(ValueError, match="must be >= 2"):
        check("--pipeline-parallel", "1")


def torchrun(world: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port",
            str(free_port()), *args]


@pytest.mark.slow
@pytest.mark.parametrize("world,quantize", [(2, None), (2, "none"), (4, None)])
def test_torchrun_smollm2_pipeline_matches_one_process(smollm2_gguf, smollm2_one_process, world, quantize):
    """`torchrun --nproc-per-node 2 generate.py --pipeline-parallel 2` on SmolLM2: one process's greedy text, on
    the file's int4 codes and dequantized, and with 4 processes (each stage 2 tensor-parallel ranks, 6 and 3 heads);
    the summary names the stages' layers and the bubble line follows."""
    extra = [] if quantize is None else ["--quantize", quantize]
    cmd, one_process = smollm2_one_process
    want = one_process(quantize).stdout
    got = run_py(*torchrun(world, *cmd, "--model", smollm2_gguf, "--pipeline-parallel", "2", *extra)[1:],
                 timeout=600)
    assert got.returncode == 0, got.stderr
    assert got.stdout == want and want.strip()
    tensor = " x tensor parallel x2" if world == 4 else ""
    assert f"pipeline parallel x2{tensor} (layers 0-18 | 19-29; 2 micro-batches)" in got.stderr
    assert re.search(r"pipeline x2: bubble [\d.]+% measured", got.stderr), got.stderr


@pytest.mark.slow
def test_torchrun_serve_pipeline_answers_8_concurrent_requests_as_one_process(smollm2, smollm2_gguf):
    """`torchrun serve.py --pipeline-parallel 2` on SmolLM2: 8 concurrent greedy completions, half of them sharing
    a prefix (prefix cache on), are one process's engine's answers; the same prompt again comes from the prefix cache;
    and a SIGTERM drains rank 0, which then stops the other rank and prints the bubble."""
    model, tokenizer = smollm2
    preamble = ("Geography facts, one per line, about the rivers, mountains, lakes and cities of Europe and Asia, "
                "written for a school quiz. ")  # longer than a KV block (16): the prompts share its blocks
    texts = [f"{preamble}{start} the capital of {country} is" for start in ("Everyone knows that", "Fact:")
             for country in ("France", "Italy", "Spain", "Japan")]
    want = [c.text for c in Engine(model, tokenizer).generate([tokenizer.encode(t) for t in texts],
                                                              max_new_tokens=10)]
    port = free_port()
    proc = subprocess.Popen(torchrun(2, "serve.py", "--model", smollm2_gguf, "--dtype", "float32", "--quantize",
                                     "none", "--port", str(port), "--pipeline-parallel", "2"),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "serve.py did not answer /health"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)

        async def ask_all() -> list[str]:
            import asyncio

            async with httpx.AsyncClient(base_url=url, timeout=300) as c:
                bodies = [{"prompt": t, "max_tokens": 10, "temperature": 0} for t in texts]
                answers = await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))
                again = (await c.post("/v1/completions", json=bodies[0])).json()
            return [a.json()["choices"][0]["text"] for a in answers], again

        import asyncio

        got, again = asyncio.run(ask_all())
        assert got == want
        assert again["choices"][0]["text"] == want[0] and again["usage"]["prompt_tokens_details"]["cached_tokens"]
    finally:
        proc.terminate()  # torchrun passes it to both ranks, then exits 1 with its own SignalException traceback
        proc.wait(timeout=60)
    log = proc.stdout.read()
    assert "shutting down" in log and "ChildFailedError" not in log, log  # rank 0 drained; no rank failed
    assert re.search(r"pipeline x2: bubble [\d.]+% measured", log), log  # every rank's clock, printed at exit
