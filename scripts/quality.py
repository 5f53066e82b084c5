"""How much quantization costs: teacher-forced KL divergence, top-1 agreement and perplexity of each quantized
variant (mode and method: rtn, gptq, awq) against the float32 model, over a text (default: the first chapters of
Pride and Prejudice in data/, disjoint from gptq.py's calibration text).

    python quality.py --model M [--text FILE] [--methods rtn,gptq,awq]   # a Markdown table on stdout
    python quality.py --model F.gguf --ctx 512 [--llama-perplexity BIN]  # the file as it runs, beside llama.cpp

With --ctx, the perplexity follows llama-perplexity's protocol: the text in chunks of ctx tokens (the first one
BOS where the vocabulary adds one), each scored on its second half.
"""
import argparse
import copy
import math
import os
import re
import subprocess
import sys

import torch
import torch.nn as nn
from tqdm import tqdm

from cli import Range, check_ranges, default_model, pick_device, read_text_file, run_cli
from kvcache import KVCache
from features.gptq import (CALIBRATION_FILE, METHODS, SEQ_LEN, calibration_sequences, quantize_calibrated,
                  sampled_sequences)
from load import load_model, resolve_model_path
from quantize import parse_mode, quantize_model, weight_bytes
from tokenizer import load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository, above scripts/
DATA_FILE = os.path.join(ROOT, "data", "pride_and_prejudice_ch1-2.txt")


@torch.no_grad()
def teacher_forced_logprobs(model: nn.Module, tokens: list[int], kv_cache_dtype: str = "model") -> torch.Tensor:
    """Log-probabilities (T, V) of every next token, the whole text in one pass through a KV cache."""
    device = model.embed_tokens.weight.device
    cache = KVCache.for_model(model.args, 1, len(tokens), model.embed_tokens.weight.dtype, device,
                              kv_dtype=kv_cache_dtype)
    x = torch.tensor([tokens], device=device)  # (1, T)
    logits = model(x, torch.arange(len(tokens), device=device), cache, all_logits=True)[0]  # (T, V)
    return torch.log_softmax(logits.float(), dim=-1)


def compare(ref: torch.Tensor, test: torch.Tensor, tokens: list[int]) -> dict[str, float]:
    """Mean KL(p_ref || p_test) per token, top-1 agreement and perplexity, from (T, V) log-probs."""
    kl = (ref.exp() * (ref - test)).sum(-1)  # (T,)
    targets = torch.tensor(tokens[1:])
    nll = -test[:-1].gather(1, targets[:, None]).mean()  # predictions of tokens 1..T-1
    return {"kl": kl.mean().item(), "top1": (ref.argmax(-1) == test.argmax(-1)).float().mean().item(),
            "ppl": math.exp(nll.item())}


def load_eval_tokens(tokenizer, text_file: str = DATA_FILE, max_tokens: int | None = None,
                     flag: str = "--text") -> list[int]:
    """The tokens of a UTF-8 text file, at most max_tokens (and at most the model's context, by the caller); one
    error line naming the flag for a missing file or one that is not UTF-8 (the byte's offset)."""
    tokens = tokenizer.encode(read_text_file(text_file, flag))
    if len(tokens) < 2:
        raise ValueError(f"{flag} {text_file!r} has fewer than 2 tokens: nothing to predict")
    return tokens[:max_tokens] if max_tokens else tokens


MODES = ("int8", "int4:32", "int4:64", "int4:128")


def variants(methods: tuple[str, ...], modes: tuple[str, ...] = MODES) -> list[tuple]:
    """(weights, mode, method, head, KV cache) of each row: the float32 rows, then each mode by round-to-nearest
    (head too) and the int4 modes by each other method."""
    rows = [("float32", None, "-", False, "model"), ("float32", None, "-", False, "int8")]
    for mode in modes:
        if "rtn" in methods:
            rows += [(mode, mode, "rtn", False, "model"), (mode, mode, "rtn", True, "model")]
        rows += [(mode, mode, m, False, "model") for m in methods if m != "rtn" and mode != "int8"]
    return rows


def evaluate(model_path: str, text_file: str = DATA_FILE, device: str = "cpu", progress: bool = False,
             methods: tuple[str, ...] = ("rtn",), calibration: list[int] | None = None,
             act_order: bool = False, sampled_tokens: int = 0, modes: tuple[str, ...] = MODES,
             tune: int = 0) -> list[dict]:
    """Rows of the quality table for the model at model_path (a float32 reference) over the text file; gptq / awq
    rows are calibrated on the tokens `calibration` (another text's) and about sampled_tokens the model writes from
    them, then their grid tuned `tune` passes."""
    ref_model, path = load_model(model_path, device, torch.float32, quantize="none")  # a GGUF's blocks dequantized
    if calibration is not None:
        seq_len = min(SEQ_LEN, ref_model.args.max_seq_len)
        calibration = (calibration_sequences(calibration, None, seq_len) +
                       sampled_sequences(ref_model, calibration, sampled_tokens, seq_len, progress=progress))
    tokens = load_eval_tokens(load_tokenizer(path), text_file, ref_model.args.max_seq_len)
    ref = teacher_forced_logprobs(ref_model, tokens)
    ref_ppl = compare(ref, ref, tokens)["ppl"]
    rows = []
    for name, mode, method, head, kv in tqdm(variants(methods, modes), desc="eval", disable=not progress):
        if mode is None:
            model = ref_model
        elif method == "rtn":
            model = quantize_model(copy.deepcopy(ref_model), mode, head)
        else:
            model = quantize_calibrated(copy.deepcopy(ref_model), mode, method, calibration,
                                        act_order and "gptq" in method, tune=tune)
        test = ref if (mode is None and kv == "model") else teacher_forced_logprobs(model, tokens, kv)
        row = compare(ref, test, tokens)
        label = method + (" act-order" if act_order and "gptq" in method else "") + (
            f" tune {tune}" if tune and method not in ("-", "rtn") else "")
        row.update(weights=name, method=label,
                   head="yes" if head else "no", kv_cache=kv, weight_bytes=weight_bytes(model),
                   dppl=row["ppl"] - ref_ppl, tokens=len(tokens))
        rows.append(row)
        del model
    return rows


def format_table(rows: list[dict]) -> str:
    lines = ["| weights | method | head quantized | KV cache | weight MB | KL(ref ‖ quant) / token | top-1 agreement | "
             "perplexity | Δ ppl |", "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['weights']} | {r['method']} | {r['head']} | {r['kv_cache']} | "
                     f"{r['weight_bytes'] / 1e6:.1f} | {r['kl']:.5f} | {r['top1']:.4f} | {r['ppl']:.3f} | "
                     f"{r['dppl']:+.3f} |")
    return "\n".join(lines)


# ---- perplexity as llama.cpp's llama-perplexity computes it ----

@torch.no_grad()
def chunked_perplexity(model: nn.Module, tokens: list[int], ctx: int, bos_id: int | None) -> tuple[float, int]:
    """(perplexity, chunks) by llama-perplexity's protocol: len(tokens) // ctx chunks of ctx tokens, the first
    token of each replaced by BOS (bos_id None: kept), each chunk's tokens ctx/2 + 1 .. ctx - 1 scored."""
    chunks = len(tokens) // ctx
    if chunks < 2:
        raise ValueError(f"--ctx {ctx}: the text has {len(tokens)} tokens, fewer than 2 x ctx (llama-perplexity's "
                         "minimum); pass a smaller --ctx or a longer --text")
    first, nll, count = ctx // 2, 0.0, 0
    for c in range(chunks):
        chunk = tokens[c * ctx:(c + 1) * ctx]
        if bos_id is not None:
            chunk = [bos_id] + chunk[1:]
        logprobs = teacher_forced_logprobs(model, chunk)  # (ctx, V)
        targets = torch.tensor(tokens[c * ctx + first + 1:(c + 1) * ctx])  # the original tokens, not the BOS
        nll -= logprobs[first:ctx - 1].gather(1, targets[:, None].to(logprobs.device)).sum().item()
        count += len(targets)
    return math.exp(nll / count), chunks


def llama_perplexity(binary: str, gguf: str, text_file: str, ctx: int) -> float:
    """The final estimate of `binary` (llama.cpp's llama-perplexity) on the file and text at context ctx, one
    thread (the caller pins the core)."""
    cmd = [binary, "-m", gguf, "-f", text_file, "-c", str(ctx), "-b", str(ctx), "-t", "1"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    except OSError as e:
        raise ValueError(f"cannot run --llama-perplexity {binary!r}: {e.strerror or e}") from None
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", done.stdout + done.stderr)
    if found is None:
        tail = (done.stdout + done.stderr).strip().splitlines()[-1:] or ["no output"]
        raise ValueError(f"{binary} printed no final estimate (exit {done.returncode}): {tail[0]}")
    return float(found[1])


def perplexity_row(model_path: str, text_file: str, ctx: int, device: str, binary: str | None) -> dict:
    """By llama-perplexity's protocol: the model as it loads by default (a GGUF's own codes, the int4 kernels' bf16
    activations), the same weights dequantized to float32 (float32 activations), and llama.cpp's own figure."""
    model, path = load_model(model_path, device, torch.float32)
    tok = load_tokenizer(path)
    tokens, bos = load_eval_tokens(tok, text_file), tok.bos_id if tok.add_bos else None
    ppl, chunks = chunked_perplexity(model, tokens, ctx, bos)
    del model
    ppl_float, _ = chunked_perplexity(load_model(path, device, torch.float32, quantize="none")[0], tokens, ctx, bos)
    theirs = llama_perplexity(binary, path, text_file, ctx) if binary else None
    return {"file": os.path.basename(path), "ctx": ctx, "chunks": chunks, "ppl": ppl, "ppl_float": ppl_float,
            "llama": theirs}


def format_perplexity(rows: list[dict]) -> str:
    lines = ["| file | ctx | chunks | ours (as loaded) | ours (float32 dequantized) | llama-perplexity | "
             "ours / theirs - 1 |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        theirs = "-" if r["llama"] is None else f"{r['llama']:.4f}"
        diff = "-" if r["llama"] is None else f"{100 * (r['ppl'] / r['llama'] - 1):+.2f}%"
        lines.append(f"| {r['file']} | {r['ctx']} | {r['chunks']} | {r['ppl']:.4f} | {r['ppl_float']:.4f} | "
                     f"{theirs} | {diff} |")
    return "\n".join(lines)


# Each numeric flag's allowed values (cli.check_ranges), checked before anything is loaded.
RANGES = {"tune": Range(0, 1000), "calibration_tokens": Range(2, 2**31), "sampled_tokens": Range(0, 2**24),
          "ctx": Range(4, 2**20)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m scripts.quality", description="Report what each quantization mode costs in quality.")
    p.add_argument("--model", default=None, help="HF folder, hub id or .gguf file (default: as generate.py)")
    p.add_argument("--text", default=DATA_FILE, metavar="FILE", help="UTF-8 text to score (default: data/)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--methods", default="rtn", help=f"comma-separated, of {', '.join(METHODS)} (default rtn)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated (default {','.join(MODES)})")
    p.add_argument("--act-order", action="store_true", help="gptq rows with act-order")
    p.add_argument("--tune", type=int, default=0, metavar="PASSES",
                   help="calibrated rows: then tune the int4 grid and the norms end to end, this many passes "
                   "(export.py --tune)")
    p.add_argument("--calibration", default=CALIBRATION_FILE, metavar="FILE",
                   help="calibration text for gptq/awq (default: data/calibration.txt; keep it apart from --text)")
    p.add_argument("--calibration-tokens", type=int, default=None, metavar="N", help="its first N tokens (all)")
    p.add_argument("--sampled-tokens", type=int, default=0, metavar="N",
                   help="also calibrate on about N tokens the model writes itself from that text (default 0)")
    p.add_argument("--ctx", type=int, default=None, help="instead: the perplexity of the model as it loads, by "
                   "llama-perplexity's protocol with this context")
    p.add_argument("--llama-perplexity", default=None, metavar="BIN", help="with --ctx: llama.cpp's tool to run too")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def run(args: argparse.Namespace) -> None:
    check_ranges(args, RANGES)
    pick_device(args.device)  # one line for a device this machine lacks, before any work
    model = args.model or default_model()
    if args.ctx is not None:
        print(format_perplexity([perplexity_row(model, args.text, args.ctx, args.device, args.llama_perplexity)]))
        return
    methods = tuple(m.strip() for m in args.methods.split(","))
    if not methods or set(methods) - set(METHODS):
        raise ValueError(f"--methods {args.methods!r}: allowed {', '.join(METHODS)}, comma-separated")
    modes = tuple(m.strip() for m in args.modes.split(","))
    for mode in modes:
        parse_mode(mode)  # a ValueError naming an unknown mode
    calibration = None
    if set(methods) - {"rtn"}:
        if os.path.abspath(args.calibration) == os.path.abspath(args.text):
            raise ValueError(f"--calibration {args.calibration!r} is the --text: calibrate on other text")
        tokens = load_eval_tokens(load_tokenizer(resolve_model_path(model)), args.calibration,
                                  flag="--calibration")
        calibration = tokens[:args.calibration_tokens] if args.calibration_tokens else tokens
    if args.tune and calibration is None:
        raise ValueError(f"--tune {args.tune}: needs a calibrated method in --methods ({args.methods})")
    print(format_table(evaluate(model, args.text, args.device, sys.stderr.isatty(), methods, calibration,
                                args.act_order, args.sampled_tokens, modes, args.tune)))


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
