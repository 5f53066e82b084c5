"""Generate text from the command line: `python generate.py --prompt "..."`.

Parses and checks the flags (every combination in check_args), loads the model, and runs one of three paths of
the library: a single prompt (decode.generate, or speculative.generate with a draft), a batch (--prompts-file:
decode.generate_batch) or a multi-turn chat (--interactive: features/chat.py). The text streams to stdout; one
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

import torch

from features import pp, tp
from cli import (add_device_flags, add_model_flags, add_parallel_flags, chat_template_arg, check_generation_config,
                 check_parallel_flags, check_seed, check_text, generation_config, model_of, pick_device, pick_dtype,
                 read_stdin, read_text_file, run_cli, set_threads, stdin_piped, version_line, weights_cache)
from decode import UNBOUNDED, Session, check_request, generate, generate_batch
from features.chat import Output, chat, chat_tokens, load_tools, step_label
from features.constraint import Constraint, check_constraint, json_schema_arg
from features.grammar import Compiler
from features.reasoning import PARSERS, tags_named
from features.sinks import SinkWindow
from features.tools import ToolRequest
from load import load_model, resolve_model_path
from model import Transformer
from quantize import describe, parse_mode, weight_bytes
from params import SamplingParams, fit_new_tokens
import speculative
from speculative import ModelDraft, PromptLookupDraft, SpecStats
from step import COMPILE_HELP, COMPILE_MODES, DETERMINISTIC_HELP, Step, check_deterministic
from text import check_stop, complete_batch
from tokenizer import load_tokenizer

DEFAULT_NEW_TOKENS = 200  # --max-new-tokens when not given (fewer when the prompt leaves less of the context)
# The sampling flags a checkpoint's generation_config.json may give defaults for (hffolder.GENERATION_SAMPLING), and
# their defaults without one.
SAMPLING_DEFAULTS = {"temperature": 0.8, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0}
MAX_LOGPROBS = 20  # --logprobs at most, as OpenAI's top_logprobs: each alternative is decoded and printed per token


def add_constraint_flags(p: argparse.ArgumentParser) -> None:
    """What shapes a reply: structured output, tool calls and the reasoning block."""
    g = p.add_argument_group("structured output (one of)")
    g.add_argument("--json-schema", default=None, metavar="FILE_OR_JSON", help="JSON valid under this schema")
    g.add_argument("--json-object", action="store_true", help="one JSON object")
    g.add_argument("--regex", default=None, metavar="PATTERN", help="the whole text matches PATTERN (Rust syntax)")
    g.add_argument("--grammar", default=None, metavar="FILE", help="Lark (`start`) or GBNF (`root`) grammar file")
    g = p.add_argument_group("tool calling (README, Tool calling)")
    g.add_argument("--tools", default=None, metavar="FILE", help="with --chat: a JSON list of OpenAI tools")
    g.add_argument("--tool-choice", default=None, metavar="CHOICE", help="auto (default), none, required or a name")
    g.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral"],
                   help="the model's call syntax (default: from the chat template, else hermes)")
    g = p.add_argument_group("reasoning (Qwen3, DeepSeek-R1: a <think> block before the answer)")
    g.add_argument("--reasoning-parser", default="auto", choices=["auto", "none", *PARSERS],
                   help="with --chat: how the reasoning block is found (default auto: when the chat template writes "
                   "<think>...</think>; think: always; none: the block is part of the answer)")
    g.add_argument("--hide-thinking", action="store_true",
                   help="with --chat: do not print the reasoning (default: on stderr, apart from the answer)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Generate text with a Llama-family model. The text goes to stdout as "
                                "it is produced; a summary line to stderr (README, Use).")
    g = p.add_argument_group("input")
    g.add_argument("-p", "--prompt", default=None, help="prompt text; - reads stdin (as does piped text)")
    g.add_argument("-f", "--prompt-file", default=None, metavar="FILE", help="the prompt is FILE's text")
    g.add_argument("--prompts-file", default=None, metavar="F", help="one batch of F's non-empty lines")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--system", default=None, help="system message for --chat")
    g.add_argument("--interactive", action="store_true", help="with --chat: a multi-turn chat on stdin")
    g.add_argument("--prompt-special-tokens", default="tokens", choices=["tokens", "text"],
                   help="without --chat: a special token's name is that token (default) or text")
    g = p.add_argument_group("sampling (default: generation_config.json's, else as below)")
    g.add_argument("--temperature", type=float, default=None,
                   help=f">= 0; 0 is greedy (default {SAMPLING_DEFAULTS['temperature']})")
    g.add_argument("--top-k", type=int, default=None, help=">= 0; 0 disables (default)")
    g.add_argument("--top-p", type=float, default=None, help="in (0, 1]; 1 disables (default)")
    g.add_argument("--min-p", type=float, default=0.0, help="in [0, 1]; 0 disables (default)")
    g.add_argument("--repetition-penalty", "--repeat-penalty", type=float, default=None,
                   help="> 0; 1 disables (default); --repeat-penalty is llama.cpp's name")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2] (default 0)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2] (default 0)")
    g.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS", help="in [-100, 100]; repeatable")
    g.add_argument("--seed", type=int, default=None, help="random seed (default: nondeterministic)")
    g = p.add_argument_group("length and output")
    g.add_argument("-n", "--max-new-tokens", type=int, default=None, metavar="N",
                   help=f">= 1, or -1: until the end of turn or a full context (default {DEFAULT_NEW_TOKENS}, or "
                   "what the prompt leaves of the context)")
    g.add_argument("-c", "--ctx-size", type=int, default=None, metavar="N",
                   help=">= 2 tokens; 0 is the model's (default), as llama.cpp")
    g.add_argument("--min-tokens", type=int, default=0, metavar="N", help="no end of turn before N tokens")
    g.add_argument("--ignore-eos", action="store_true", help="run to --max-new-tokens")
    g.add_argument("--stop", action="append", default=[], metavar="STR", help="stop at STR (repeatable)")
    g.add_argument("--logprobs", type=int, default=None, metavar="N", help=f"N in [0, {MAX_LOGPROBS}] alternatives")
    g.add_argument("--json", action="store_true", help="one JSON object per completion instead of the text")
    g.add_argument("--quiet", action="store_true", help="no progress bars and no summary line")
    add_constraint_flags(p)
    g = p.add_argument_group("model and runtime")
    add_model_flags(g)
    add_device_flags(g)
    g.add_argument("--compile", nargs="?", const="full", default="auto", choices=COMPILE_MODES,
                   help=f"torch.compile the decode step; --compile alone is full. {COMPILE_HELP}")
    g.add_argument("--compile-prefill", action="store_true", help="--compile full, and the prefill too")
    g.add_argument("--deterministic", action="store_true", help=DETERMINISTIC_HELP)
    add_parallel_flags(g)
    g.add_argument("--quantize", default=None, metavar="MODE", help="int8, int4[:GROUP] or none (default: as stored)")
    g.add_argument("--quantize-head", action="store_true", help="with --quantize: the LM head too")
    g.add_argument("--kv-cache-dtype", default="model", choices=["model", "int8"], help="KV cache storage")
    g.add_argument("--cache-window", type=int, default=None, metavar="W", help="rolling KV cache (Attention sinks)")
    g.add_argument("--sink-tokens", type=int, default=None, metavar="S", help="with --cache-window: kept (default 4)")
    g = p.add_argument_group("speculative decoding (one draft)")
    g.add_argument("--draft-model", default=None, metavar="M", help="draft model M (the same vocabulary)")
    g.add_argument("--draft-quantize", default=None, metavar="MODE", help="the target (or draft) quantized MODE")
    g.add_argument("--prompt-lookup", action="store_true", help="draft from earlier matches in the context")
    g.add_argument("--speculate-k", type=int, default=4, metavar="K", help="tokens per draft, >= 1 (default 4)")
    p.add_argument("--version", action="version", version=version_line())
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the flags ask for, checked and derived once (check_args) before anything loads."""
    params: SamplingParams  # the flags' own; checkpoint_sampling adds generation_config.json's defaults
    constraint: Constraint | None  # structured output's (--tools brings its own once the tokenizer has loaded)
    window: SinkWindow | None  # --cache-window's rolling cache, checked but for the model's context
    speculating: bool  # a draft: --draft-model, --draft-quantize or --prompt-lookup
    chat_template: str | None = None  # --chat-template's, in place of the model's


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
    return None if args.grammar is None else Constraint("grammar", read_text_file(args.grammar, "grammar file"))


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


def check_args(args: argparse.Namespace) -> Plan:
    """Every flag and flag combination, checked before anything loads, as the plan they give."""
    given = {name: getattr(args, name) for name in SAMPLING_DEFAULTS if getattr(args, name) is not None}
    params = SamplingParams(**SAMPLING_DEFAULTS | given, min_p=args.min_p, presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty, logit_bias=logit_bias_arg(args.logit_bias),
                            min_tokens=args.min_tokens, ignore_eos=args.ignore_eos)
    if args.max_new_tokens is not None and args.max_new_tokens < 1 and args.max_new_tokens != -1:
        raise ValueError(f"--max-new-tokens must be >= 1, or -1 (until the end of turn or a full context), got "
                         f"{args.max_new_tokens}")
    check_stop(args.stop)
    if args.logprobs is not None and not 0 <= args.logprobs <= MAX_LOGPROBS:
        raise ValueError(f"--logprobs must be in [0, {MAX_LOGPROBS}] (the number of alternatives per token, at most "
                         f"OpenAI's top_logprobs limit), got {args.logprobs}")
    for flag, text in (("--prompt", args.prompt), ("--system", args.system), *(("--stop", t) for t in args.stop)):
        check_text(flag, text)
    if args.ctx_size is not None and args.ctx_size < 2 and args.ctx_size != 0:
        raise ValueError(f"--ctx-size must be >= 2 (a prompt token and a new one), or 0 (the model's), got "
                         f"{args.ctx_size}")
    check_seed(args.seed)
    constraint = constraint_of(args)
    if constraint is not None:
        check_constraint(constraint)
    check_tool_flags(args)
    check_inputs(args)
    for flag, mode in (("--quantize", args.quantize), ("--draft-quantize", args.draft_quantize)):
        if mode is not None and (mode, flag) != ("none", "--quantize"):
            parse_mode(mode)
    if args.quantize_head and args.quantize is None:
        raise ValueError("quantize_head (--quantize-head) needs a quantization mode (--quantize)")
    if args.deterministic:
        check_deterministic(args.compile, args.compile_prefill)
    if args.speculate_k < 1:
        raise ValueError(f"--speculate-k must be >= 1, got {args.speculate_k}")
    speculating = bool(args.draft_model or args.draft_quantize or args.prompt_lookup)
    if speculating:
        check_speculation(args, params, constraint)
    if tp.launched() and args.interactive:
        raise ValueError("tensor parallel (torchrun) does not support --interactive")
    check_parallel_flags(args)
    if args.pipeline_parallel is not None:
        pp.check_world(args.pipeline_parallel)
    model_of(args)  # -m and -hf: one of them, -hf a hub id
    check_generation_config(args.generation_config)
    if args.chat_template is not None and not args.chat:
        raise ValueError("--chat-template needs --chat (it renders the chat's messages)")
    return Plan(params, constraint, window_of(args), speculating, chat_template_arg(args.chat_template))


def check_inputs(args: argparse.Namespace) -> None:
    """Where the prompt comes from: one source, or the turns of --interactive (which needs --chat)."""
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


def check_speculation(args: argparse.Namespace, params: SamplingParams, constraint: Constraint | None) -> None:
    """What a draft cannot go with: another draft, and the features speculative.generate lacks."""
    if args.prompt_lookup and (args.draft_model or args.draft_quantize):
        raise ValueError("--prompt-lookup is a draft of its own; it cannot take --draft-model/--draft-quantize")
    for flag, used in (("penalties", params.penalized), ("--logprobs", args.logprobs is not None),
                       ("structured output (--json-schema, --json-object, --regex, --grammar)", constraint is not None),
                       ("--tools", args.tools), ("--prompts-file", args.prompts_file),
                       ("--interactive", args.interactive), ("--kv-cache-dtype int8", args.kv_cache_dtype != "model"),
                       ("--cache-window", args.cache_window is not None),
                       ("tensor parallel (torchrun)", tp.launched())):
        if used:
            raise ValueError(f"{flag} is not supported with speculative decoding")


def check_tool_flags(args: argparse.Namespace) -> None:
    """--tools' combinations: it needs --chat and one conversation (a structured-output flag with it is the format
    of an answer that is no call)."""
    if args.tools is None:
        for flag, value in (("--tool-choice", args.tool_choice), ("--tool-call-parser", args.tool_call_parser)):
            if value is not None:
                raise ValueError(f"{flag} needs --tools")
    elif not args.chat:
        raise ValueError("--tools needs --chat (the tools are rendered with the chat template)")
    elif args.prompts_file:
        raise ValueError("--tools takes one conversation (--prompt or --interactive), not --prompts-file")


def window_of(args: argparse.Namespace) -> SinkWindow | None:
    """--cache-window and --sink-tokens as the rolling cache's shape (None without one), checked but for the model's
    context (context_of checks that)."""
    if args.cache_window is None:
        if args.sink_tokens is not None:
            raise ValueError("--sink-tokens needs --cache-window (the rolling cache the sinks stay in)")
        return None
    if args.ctx_size:
        raise ValueError("--cache-window lets a sequence run past the context; it cannot take --ctx-size")
    window = SinkWindow(4 if args.sink_tokens is None else args.sink_tokens, args.cache_window)
    window.check()
    return window


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
    return text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text


def read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompt texts the flags ask for: one (one_prompt), or the lines of --prompts-file; with --interactive
    none: each turn is rendered as it comes."""
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


def checkpoint_sampling(plan: Plan, args: argparse.Namespace,
                        path: str) -> tuple[SamplingParams, dict[str, float | int]]:
    """The plan's parameters with the defaults of the checkpoint's generation_config.json (a Hugging Face folder's;
    --generation-config says which, or none) for the sampling flags not given, and those defaults; the flags given
    always win."""
    found = generation_config(args.generation_config, path)
    defaults = {k: v for k, v in found.items() if getattr(args, k) is None}
    params = dataclasses.replace(plan.params, **defaults)  # each value checked by generation_config
    if plan.speculating and params.penalized:
        raise ValueError(f"the model's generation_config.json sets repetition_penalty {params.repetition_penalty}, "
                         "which is not supported with speculative decoding; pass --repetition-penalty 1")
    return params, defaults


def context_of(plan: Plan, args: argparse.Namespace, model: Transformer) -> tuple[int, str]:
    """The tokens a sequence may fill (prompt and output; the KV cache holds no more) and how errors name it: the
    model's context, or --ctx-size below it; unbounded with --cache-window (the cache rolls)."""
    if plan.window is not None:
        plan.window.check(model.args.max_seq_len)
        return UNBOUNDED, "the rolling cache's limit"
    if not args.ctx_size:  # unset, or 0: the model's
        return model.args.max_seq_len, "the model's context"
    if args.ctx_size > model.args.max_seq_len:
        raise ValueError(f"--ctx-size {args.ctx_size} is larger than the model's context of {model.args.max_seq_len}")
    return args.ctx_size, "the context (--ctx-size)"


def new_tokens(asked: int | None, prompt_tokens: int, context: int, what: str = "the model's context") -> int:
    """--max-new-tokens by the server's max_tokens rule (decode.fit_new_tokens), DEFAULT_NEW_TOKENS when not given;
    -1 is all the context leaves (llama.cpp's -n -1; through a rolling cache, no bound: until the end of turn)."""
    if asked == -1:
        return max(1, context - prompt_tokens)
    return fit_new_tokens(asked, DEFAULT_NEW_TOKENS, prompt_tokens, context, "--max-new-tokens", what)


def setup_summary(plan: Plan, args: argparse.Namespace, model: Transformer, shard, context: int, from_config: dict,
                  constraint: Constraint | None, tools: ToolRequest | None) -> str:
    """The summary line's tail: the sharding, what decode reads per token (weights 87.1 MB int4:64 (+head), kv
    int8; under tensor parallel each rank's), the window, the context, the checkpoint's sampling, the constraint."""
    label = describe(model)  # read off every block linear: a Q4_K_M file's first o_proj may be dequantized
    if shard is None:
        setup = f" | weights {weight_bytes(model) / 1e6:.1f} MB"
    else:  # every rank's, gathered (rank 0 prints them)
        per_rank = " + ".join(f"{n / 1e6:.1f}" for n in tp.each_rank(weight_bytes(model)))
        setup = f" | tensor parallel x{shard.world}" if not isinstance(model, pp.Pipeline) else pp.summary(model)
        setup += f" | weights per rank {per_rank} MB"
    setup += "" if label == "float" else " " + label
    setup += " | kv int8" if args.kv_cache_dtype == "int8" else ""
    setup += f" | kv window {args.cache_window} ({plan.window.sinks} sinks)" if plan.window is not None else ""
    setup += f" | context {context}" if args.ctx_size else ""
    if from_config:
        setup += f" | sampling: generation_config.json ({', '.join(f'{k} {v}' for k, v in from_config.items())})"
    if constraint is not None:
        setup += f" | {constraint.kind.replace('_', ' ')}" if tools is None else \
            f" | tools {tools.mode} ({tools.format.name})"
    return setup


def tokenize(args: argparse.Namespace, path: str, texts: list[str], chat_template: str | None = None):
    """The tokenizer, --tools, the system message (a list of none or one) and the prompts' tokens (with --chat
    rendered by the chat template, or chat_template in its place; none with --interactive), before the weights
    load: a broken tokenizer file or chat template fails in a moment."""
    tokenizer = load_tokenizer(path)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if args.chat and tokenizer.chat_template is None:
        raise ValueError(f"--chat needs a chat template, and the tokenizer of {path!r} has none")
    system = [{"role": "system", "content": args.system}] if args.system else []
    tools = None if args.tools is None else load_tools(args.tools, args.tool_choice, args.tool_call_parser, tokenizer)
    prompts = [chat_tokens(tokenizer, system + [{"role": "user", "content": t}], tools) if args.chat else
               tokenizer.encode(t, special=args.prompt_special_tokens == "tokens") for t in texts]
    return tokenizer, tools, system, prompts


def make_draft(args: argparse.Namespace, model: Transformer, path: str, device: torch.device, dtype: torch.dtype,
               progress: bool, decode_steps: int | None) -> ModelDraft | PromptLookupDraft:
    """The draft the flags ask for: prompt lookup, --draft-model, or the target loaded again quantized."""
    if args.prompt_lookup:
        return PromptLookupDraft()
    draft, _ = load_model(args.draft_model or path, device, dtype, progress=progress, quantize=args.draft_quantize,
                          cache_dir=weights_cache(args.weights_cache))
    step = Step(draft, args.compile, args.compile_prefill, decode_steps=decode_steps)  # run as the target is
    return ModelDraft(draft.eval(), model, step)


def load_for(args: argparse.Namespace, path: str, device: torch.device, dtype: torch.dtype, progress: bool,
             shard: tp.Shard | None) -> Transformer:
    """The model this process runs: the whole; under torchrun its tensor-parallel slice (tp.install), or with
    --pipeline-parallel its stage (pp.split) of the whole or of its slice."""
    stage, group = pp.place(shard, args.pipeline_parallel) if args.pipeline_parallel else (None, None)
    # Quantizing while loading (tensor by tensor) keeps the full-precision model out of memory.
    model, _ = load_model(path, device, dtype, progress=progress, quantize=args.quantize,
                          quantize_head=args.quantize_head, shard=shard if stage is None else stage.shard(),
                          cache_dir=weights_cache(args.weights_cache))
    if stage is not None:  # this rank's stage of the model (of its tensor-parallel slice), whole as loaded
        model = pp.split(model, stage, args.micro_batches or args.pipeline_parallel)
    if shard is not None and (stage is None or stage.tp_world > 1):
        tp.install(model, group)
    return model


def report_bubble(model: Transformer, quiet: bool) -> None:
    """Under pipeline parallel, every rank's clock, gathered (every rank calls it); rank 0 prints the bubble."""
    if isinstance(model, pp.Pipeline):
        bubble = model.report()
        if not quiet:
            print(bubble, file=sys.stderr)


def run(args: argparse.Namespace) -> None:
    plan = check_args(args)
    set_threads(args.threads)
    texts = read_prompts(args)
    first_turn = one_prompt(args) if args.interactive else None
    device, shard = pick_device(args.device), tp.from_env()  # torchrun with several processes: tensor parallel
    if shard is not None:
        device = tp.device_for(shard, device)
        if shard.rank > 0:  # every rank computes the same tokens; rank 0 alone writes them
            args.quiet, sys.stdout = True, open(os.devnull, "w")
    dtype, dtype_why = pick_dtype(args.dtype, device)
    progress = not args.quiet and sys.stderr.isatty()
    path = resolve_model_path(model_of(args), hub=args.hf_repo is not None)
    params, from_config = checkpoint_sampling(plan, args, path)
    tokenizer, tools, system, prompts = tokenize(args, path, texts, plan.chat_template)
    model = load_for(args, path, device, dtype, progress, shard)
    context, what = context_of(plan, args, model)
    for prompt in prompts:
        check_request(prompt, 1, context, what)
    seed = args.seed if args.seed is not None else torch.Generator().seed()  # leaves torch's global RNG alone
    generator = torch.Generator(device=device).manual_seed(seed if shard is None else tp.same_seed(seed, device))
    # auto compiles where it pays: an answer long enough, or a chat once its answers have decoded as many
    n_new = None if args.interactive else new_tokens(args.max_new_tokens, max(map(len, prompts)), context, what)
    step = Step(model, "none" if args.pipeline_parallel else args.compile, args.compile_prefill, args.deterministic,
                n_new, pay_as_you_go=args.interactive)
    constraint = plan.constraint if tools is None else tools.constraint_with(plan.constraint) or plan.constraint
    grammar = None if constraint is None else Compiler(tokenizer, model.args.vocab_size).compile(constraint)
    grammar = grammar if tools is None or grammar is None else tools.grammar(grammar)  # a repeated call ends it
    setup = setup_summary(plan, args, model, shard, context, from_config, constraint, tools)
    where = f"{device.type} {str(dtype).removeprefix('torch.')} ({dtype_why})"
    out = Output(tokenizer, args.stop, args.json, args.logprobs, args.quiet, tools,
                 lambda: f"{where} | {step_label(step, args.compile, args.compile_prefill)}{setup}",
                 reasoning=tags_named(args.reasoning_parser, tokenizer.chat_template) if args.chat else None,
                 show_thinking=not args.hide_thinking)
    run_one = dict(model=model, params=params, generator=generator, stop_ids=tokenizer.eos_ids, step=step,
                   logprobs=args.logprobs, grammar=grammar)
    if args.interactive:
        session = Session(model, context, kv_dtype=args.kv_cache_dtype, window=plan.window)
        chat(out, step, session, system, first_turn, lambda prompt: generate(
            prompt=prompt, max_new_tokens=new_tokens(args.max_new_tokens, len(prompt), context, what),
            session=session, **run_one))
    elif args.prompts_file:
        rows = generate_batch(prompts=prompts, max_new_tokens=n_new, kv_dtype=args.kv_cache_dtype,
                              window=plan.window, **run_one)
        out.batch(complete_batch(rows, tokenizer, [len(p) for p in prompts], stop=args.stop))
    elif plan.speculating:  # the same tokens and distribution, up to --speculate-k tokens per target forward
        stats = SpecStats(args.speculate_k)
        tokens = speculative.generate(model, make_draft(args, model, path, device, dtype, progress, n_new),
                                      prompts[0], max_new_tokens=n_new, params=params, generator=generator,
                                      stop_ids=tokenizer.eos_ids, k=args.speculate_k, stats=stats, step=step)
        out.report(out.reply(tokens, len(prompts[0]))[0], step.mode != "none")
        if not args.quiet:
            print(stats.report(), file=sys.stderr)
    else:
        tokens = generate(prompt=prompts[0], max_new_tokens=n_new, kv_dtype=args.kv_cache_dtype, window=plan.window,
                          **run_one)
        out.report(out.reply(tokens, len(prompts[0]))[0], step.mode != "none")
    report_bubble(model, args.quiet)


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
