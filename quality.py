"""How much quantization costs: teacher-forced KL divergence, top-1 agreement and perplexity of each quantized
variant against the float32 model, over a text (default: the first chapters of Pride and Prejudice in data/).

    python quality.py --model M [--text FILE]   # a Markdown table on stdout
"""
import argparse
import copy
import math
import os
import sys

import torch
import torch.nn as nn
from tqdm import tqdm

from cli import default_model, run_cli
from kvcache import KVCache
from load import load_model
from quantize import quantize_model, weight_bytes
from tokenizer import load_tokenizer

DATA_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "pride_and_prejudice_ch1-2.txt")


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


def load_eval_tokens(tokenizer, text_file: str = DATA_FILE, max_tokens: int | None = None) -> list[int]:
    """The tokens of a UTF-8 text file, at most max_tokens (and at most the model's context, by the caller)."""
    try:
        with open(text_file, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read --text {text_file!r}: {e}") from None
    tokens = tokenizer.encode(text)
    if len(tokens) < 2:
        raise ValueError(f"--text {text_file!r} has fewer than 2 tokens: nothing to predict")
    return tokens[:max_tokens] if max_tokens else tokens


def evaluate(model_path: str, text_file: str = DATA_FILE, device: str = "cpu", progress: bool = False) -> list[dict]:
    """Rows of the quality table for the model at model_path (a float32 reference) over the text file."""
    ref_model, path = load_model(model_path, device, torch.float32, quantize="none")  # a GGUF's blocks dequantized
    tokens = load_eval_tokens(load_tokenizer(path), text_file, ref_model.args.max_seq_len)
    variants = [("float32", None, False, "model"), ("float32", None, False, "int8")]
    for mode in ("int8", "int4:32", "int4:64", "int4:128"):
        variants += [(mode, mode, False, "model"), (mode, mode, True, "model")]
    ref = teacher_forced_logprobs(ref_model, tokens)
    ref_ppl = compare(ref, ref, tokens)["ppl"]
    rows = []
    for name, mode, head, kv in tqdm(variants, desc="eval", disable=not progress):
        model = ref_model if mode is None else quantize_model(copy.deepcopy(ref_model), mode, head)
        test = ref if (mode is None and kv == "model") else teacher_forced_logprobs(model, tokens, kv)
        row = compare(ref, test, tokens)
        row.update(weights=name, head="yes" if head else "no", kv_cache=kv, weight_bytes=weight_bytes(model),
                   dppl=row["ppl"] - ref_ppl, tokens=len(tokens))
        rows.append(row)
        del model
    return rows


def format_table(rows: list[dict]) -> str:
    lines = ["| weights | head quantized | KV cache | weight MB | KL(ref ‖ quant) / token | top-1 agreement | "
             "perplexity | Δ ppl |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['weights']} | {r['head']} | {r['kv_cache']} | {r['weight_bytes'] / 1e6:.1f} | "
                     f"{r['kl']:.5f} | {r['top1']:.4f} | {r['ppl']:.3f} | {r['dppl']:+.3f} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Report what each quantization mode costs in quality.")
    p.add_argument("--model", default=None, help="HF folder, hub id or .gguf file (default: as generate.py)")
    p.add_argument("--text", default=DATA_FILE, metavar="FILE", help="UTF-8 text to score (default: data/)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    print(format_table(evaluate(args.model or default_model(), args.text, args.device, sys.stderr.isatty())))


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
