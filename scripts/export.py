"""Write a quantized checkpoint folder that `generate.py --model DIR` loads:

    python export.py --model M --mode int4:64 --out DIR
    python export.py --model M --mode int4:64 --method awq+round [--calibration FILE] [--sampled-tokens N] --out DIR
    python export.py --model M --mode int4:128 --method awq+gptq --act-order --out DIR

--method rtn rounds each weight to the nearest code; gptq, awq, awq+gptq, round and awq+round (gptq.py) use the
activations of calibration text, and of about N tokens the model writes itself from it.

model.safetensors holds the quantized modules' tensors with the mode in its metadata (hffolder.read_quantization),
beside config.json and the tokenizer files (copied from a Hugging Face folder, or built from a GGUF vocabulary).
"""
import argparse
import json
import os
import shutil
import sys
import tempfile

import torch
import torch.nn as nn

from cli import Range, check_ranges, default_model, run_cli
from features.gptq import (CALIBRATION_FILE, METHODS, SEQ_LEN, calibration_sequences, quantize_calibrated,
                  sampled_sequences)
from formats.hffolder import read_quantization
from formats.checkpoint import checkpoint_state
from load import load_model, resolve_model_path
from quantize import MODES_HELP, parse_mode, quantization_of, weight_bytes
from tokenizer import load_tokenizer

OUT_FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
             "tokenizer.model", "special_tokens_map.json", "generation_config.json", "chat_template.jinja")


def gguf_tokenizer_files(gguf_path: str) -> dict[str, str]:
    """The texts of tokenizer.json (the tokenizers backend built from the GGUF vocabulary), tokenizer_config.json and
    generation_config.json, by file name."""
    from tokenizers import processors

    tok = load_tokenizer(gguf_path)
    backend = tok.backend
    # A folder's tokenizer adds BOS/EOS only through tokenizer.json's post-processor.
    single = ([tok.bos_token] if tok.add_bos else []) + ["$A"] + ([tok.eos_token] if tok.add_eos else [])
    if len(single) > 1:
        special = [(t, backend.token_to_id(t)) for t in (tok.bos_token, tok.eos_token) if t in single]
        backend.post_processor = processors.TemplateProcessing(single=single, special_tokens=special)
    cfg = {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "add_bos_token": tok.add_bos,
           "add_eos_token": tok.add_eos, "tokenizer_class": "PreTrainedTokenizerFast"}
    if tok.chat_template:
        cfg["chat_template"] = tok.chat_template
    return {"tokenizer.json": backend.to_str(pretty=True),
            "tokenizer_config.json": json.dumps(cfg, indent=2, ensure_ascii=False),
            "generation_config.json": json.dumps({"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_ids}, indent=2)}


def partial_name(name: str) -> str:
    """The name an output file is written under until it is complete (then os.replace gives it its own)."""
    return f".{name}.partial"


def check_out_folder(out: str) -> None:
    """Refuse a non-empty --out folder unless it holds only a previous output of this command (or the partial files
    of one that was killed), and a folder that cannot be made or written to: checked before the model is loaded and
    quantized, not after."""
    if not out:
        raise ValueError("--out is empty; pass the folder to write to")
    folder = out  # where a file must be creatable: out, or the nearest existing folder above it
    if not os.path.exists(out):
        folder = os.path.dirname(os.path.abspath(out))
        while not os.path.exists(folder):
            folder = os.path.dirname(folder)
        if not os.path.isdir(folder):
            raise ValueError(f"--out {out!r} cannot be created: {folder!r} is a file, not a folder")
    elif not os.path.isdir(out):
        raise ValueError(f"--out {out!r} exists and is not a folder")
    else:
        entries = sorted(set(os.listdir(out)) - {partial_name(name) for name in OUT_FILES})
        foreign = [e for e in entries if e not in OUT_FILES]
        previous = "model.safetensors" in entries and previous_output(os.path.join(out, "model.safetensors"))
        if entries and (foreign or not previous):
            raise ValueError(f"--out {out!r} is not empty and is not a previous export.py output "
                             f"({', '.join((foreign or entries)[:3])} ...); choose an empty or new folder")
    # Permission bits do not say it all (root passes them; /proc and read-only mounts refuse anyway): try it.
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".export-probe-")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"--out {out!r} cannot be written: {e.strerror or e} (in {folder!r})") from None


def previous_output(file: str) -> bool:
    """Whether file is the model.safetensors of a previous export (quantization in its metadata)."""
    try:
        return read_quantization(file) is not None
    except Exception:  # safetensors' own error types: a corrupt file is no previous output
        return False


def check_not_source(out: str, source: str) -> None:
    """Refuse an --out that is the source folder, or where a file this command writes is one of the source's files
    (the same file under another name counts: a link)."""
    if os.path.isdir(source) and os.path.isdir(out) and os.path.samefile(out, source):
        raise ValueError(f"--out {out!r} is the source model folder {source!r}; choose another folder")
    files = [os.path.join(source, name) for name in os.listdir(source)] if os.path.isdir(source) else [source]
    ids = {(st.st_dev, st.st_ino) for st in map(os.stat, filter(os.path.isfile, files))}
    for name in OUT_FILES:
        target = os.path.join(out, name)
        if os.path.isfile(target) and (os.stat(target).st_dev, os.stat(target).st_ino) in ids:
            raise ValueError(f"--out {out!r}: writing {name} would overwrite a file of the source model "
                             f"{source!r}; choose another folder")


def save_quantized(model: nn.Module, source: str, out: str) -> None:
    """Write model.safetensors (quantization in its metadata), config.json and the tokenizer files to out. Each is
    written under its partial_name and renamed when all are complete, so a failed or killed export never leaves a
    half-written file under an output name; a previous output's files this one does not write are removed."""
    from safetensors.torch import save_file

    meta = quantization_of(model)
    assert meta is not None, "save_quantized needs a quantized model"
    state = {k: v.contiguous() for k, v in checkpoint_state(model).items()}  # the usual names, q/k/v apart
    os.makedirs(out, exist_ok=True)
    written = []

    def partial(name: str) -> str:
        written.append(name)
        return os.path.join(out, partial_name(name))

    try:
        save_file(state, partial("model.safetensors"), metadata={"format": "pt", **meta})
        if os.path.isdir(source):
            for name in OUT_FILES[1:]:
                if os.path.isfile(os.path.join(source, name)):
                    shutil.copyfile(os.path.join(source, name), partial(name))
        else:
            texts = {"config.json": json.dumps(model.args.to_hf_config(), indent=2), **gguf_tokenizer_files(source)}
            for name, text in texts.items():
                with open(partial(name), "w", encoding="utf-8") as f:
                    f.write(text)
    except BaseException:  # also Ctrl-C: no partial file stays behind
        for name in written:
            if os.path.exists(os.path.join(out, partial_name(name))):
                os.remove(os.path.join(out, partial_name(name)))
        raise
    for name in written:
        os.replace(os.path.join(out, partial_name(name)), os.path.join(out, name))
    for name in set(OUT_FILES) - set(written):  # e.g. a chat_template.jinja that would override the new template
        if os.path.isfile(os.path.join(out, name)):
            os.remove(os.path.join(out, name))


# Each numeric flag's allowed values (cli.check_ranges), checked before anything is loaded.
RANGES = {"calibration_tokens": Range(2, 2**31), "sampled_tokens": Range(0, 2**24), "tune": Range(0, 1000)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m scripts.export", description="Quantize a checkpoint and write it to a folder.")
    p.add_argument("--model", default=None, help="HF folder, hub id or .gguf file (default: as generate.py)")
    p.add_argument("--mode", required=True, help=MODES_HELP)
    p.add_argument("--quantize-head", action="store_true", help="quantize the LM head too")
    p.add_argument("--out", required=True, help="folder to write the quantized checkpoint to")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the scales and of the unquantized weights (default bfloat16)")
    p.add_argument("--method", default="rtn", choices=METHODS,
                   help="rtn: round to nearest (default); gptq, awq, awq+gptq (AWQ's scales, then GPTQ), round "
                   "(learned rounding), awq+round: int4 from calibration activations (gptq.py)")
    p.add_argument("--calibration", default=CALIBRATION_FILE, metavar="FILE",
                   help="UTF-8 calibration text for gptq/awq (default: data/calibration.txt)")
    p.add_argument("--calibration-tokens", type=int, default=None, metavar="N",
                   help="use the text's first N tokens (default: all)")
    p.add_argument("--sampled-tokens", type=int, default=0, metavar="N",
                   help="gptq/awq: also calibrate on about N tokens the model writes itself from the text (default 0)")
    p.add_argument("--act-order", action="store_true", help="gptq: round the inputs of largest activation first")
    p.add_argument("--tune", type=int, default=0, metavar="PASSES",
                   help="then tune the groups' scales and zeros (codes fixed) and the norms' weights end to end on "
                   "the calibration text, this many passes (default 0; keeps a float copy of the model)")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def check_method(args: argparse.Namespace) -> None:
    """A ValueError for a flag out of its range or flags that do not go together, before anything is loaded."""
    check_ranges(args, RANGES)
    kind, _ = parse_mode(args.mode)
    if args.method == "rtn" and (args.act_order or args.calibration != CALIBRATION_FILE or args.calibration_tokens
                                 or args.sampled_tokens or args.tune):
        raise ValueError("--act-order, --calibration, --calibration-tokens, --sampled-tokens and --tune need a "
                         f"calibrated --method ({', '.join(METHODS[1:])})")
    if args.method != "rtn" and (kind != "int4" or args.quantize_head):
        raise ValueError(f"--method {args.method} makes the block linears int4:G; got --mode {args.mode}"
                         f"{' with --quantize-head (the head takes --method rtn)' if args.quantize_head else ''}")


def calibrated_model(args: argparse.Namespace, source: str):
    """The float model quantized with GPTQ / AWQ / learned rounding on the calibration text and the text it
    samples from it."""
    from scripts.quality import load_eval_tokens

    model, path = load_model(source, "cpu", getattr(torch, args.dtype), progress=sys.stderr.isatty(), quantize="none")
    tokens = load_eval_tokens(load_tokenizer(path), args.calibration, flag="--calibration")
    seq_len = min(SEQ_LEN, model.args.max_seq_len)
    tokens = tokens[:args.calibration_tokens] if args.calibration_tokens else tokens
    seqs = calibration_sequences(tokens, None, seq_len)
    seqs += sampled_sequences(model, tokens, args.sampled_tokens, seq_len, progress=sys.stderr.isatty())
    return quantize_calibrated(model, args.mode, args.method, seqs, args.act_order, sys.stderr.isatty(), args.tune)


def run(args: argparse.Namespace) -> None:
    check_method(args)
    check_out_folder(args.out)  # before resolving the model: a bad --out fails before a hub download, too
    source = resolve_model_path(args.model or default_model())
    check_not_source(args.out, source)
    if args.method == "rtn":
        model, _ = load_model(source, "cpu", getattr(torch, args.dtype), progress=sys.stderr.isatty(),
                              quantize=args.mode, quantize_head=args.quantize_head)
    else:
        model = calibrated_model(args, source)
    try:
        save_quantized(model, source, args.out)
    except OSError as e:  # e.g. the disk filled up while writing
        raise ValueError(f"cannot write to --out {args.out!r}: {e.strerror or e}") from None
    print(f"wrote {args.out} ({args.mode} {args.method}{' act-order' if args.act_order else ''}"
          f"{f' tune {args.tune}' if args.tune else ''}"
          f"{', head quantized' if args.quantize_head else ''}, "
          f"weights {weight_bytes(model) / 1e6:.1f} MB)", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
