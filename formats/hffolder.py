"""Reading a Hugging Face model folder: config.json and the safetensors index as checked JSON, the sampling defaults
of generation_config.json, the safetensors files' headers and quantization metadata, and their tensors under this
runtime's names (Mixtral's per-expert and stacked expert layouts), each read on its own (one expert of a stacked
tensor; with a tp.Shard, only its slice). Which tensor goes where is load.py's.
"""
import json
import os
import re

import torch

from config import ModelArgs

# Mixtral's original per-expert names -> ours (w1 gate, w3 up, w2 down, as the Mixtral paper's SwiGLU names them).
HF_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
GENERATION_SAMPLING = ("temperature", "top_k", "top_p", "repetition_penalty")  # what generation_config.json may set


def read_json(path: str) -> dict:
    """A JSON object from a file; anything else (unreadable, not UTF-8, not JSON, a list) is a ValueError."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, not a {type(value).__name__}")
    return value


def generation_defaults(path: str) -> dict[str, float | int]:
    """The sampling defaults a Hugging Face folder's generation_config.json sets (those of GENERATION_SAMPLING it
    has, as vLLM reads them: do_sample is not consulted); {} for a GGUF file (it has none) or a folder without one.
    A value that is no number (top_k: no integer) is a ValueError naming the file."""
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return {}
    config = read_json(file)
    found = {k: config[k] for k in GENERATION_SAMPLING if config.get(k) is not None}
    for k, v in found.items():
        if isinstance(v, bool) or not isinstance(v, int if k == "top_k" else (int, float)):
            raise ValueError(f"{file}: {k} must be {'an integer' if k == 'top_k' else 'a number'}, got {v!r}")
    return found


def safetensors_files(path: str) -> list[str]:
    """The folder's safetensors files: model.safetensors, or the shards its index lists (each must exist)."""
    index_file = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_file):
        weight_map = read_json(index_file).get("weight_map")  # tensor name -> shard file
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index_file} has no weight_map object of tensor names and file names")
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path!r}")
    for file in files:
        if not os.path.isfile(os.path.join(path, file)):
            raise FileNotFoundError(f"safetensors shard {os.path.join(path, file)!r} listed in the index is missing")
    return files


def open_safetensors(path: str, files: list[str], gpt_oss: bool = False) -> tuple[dict, dict[str, tuple]]:
    """({file: handle}, {our name: (file, key, shape, pick, safetensors dtype)}), nothing read but the headers."""
    from safetensors import safe_open

    handles, found = {}, {}
    for file in files:
        full = os.path.join(path, file)
        try:
            handles[file] = safe_open(full, framework="pt", device="cpu")
            for key in handles[file].keys():
                part = handles[file].get_slice(key)
                for name, shape, pick in tensor_names(key, part.get_shape(), gpt_oss):
                    kind = "MXFP4" if pick and pick[0] == "mxfp4" else part.get_dtype()  # decoded as read
                    found[name] = (file, key, shape, pick, kind)
        except Exception as e:  # safetensors raises its own error types for corrupt or truncated files
            raise ValueError(f"cannot read safetensors file {full!r}: {e}") from None
    return handles, found


def read_quantization(file: str) -> dict[str, str] | None:
    """The quantization entries of a safetensors file's metadata, or None if it is not quantized."""
    from safetensors import safe_open

    with safe_open(file, framework="pt") as f:
        meta = f.metadata() or {}
    keys = ("quantization", "group_size", "quantize_head") + (("act_order",) if "act_order" in meta else ())
    return {k: meta[k] for k in keys} if "quantization" in meta else None


def tensor_names(key: str, shape: tuple[int, ...], gpt_oss: bool = False) -> list[tuple[str, tuple, tuple | None]]:
    """The tensors a safetensors key holds, under our checkpoint names: [(name, shape, pick)], pick None for the
    tensor itself or (expert, first row, rows) of a stacked (E, N, K) expert tensor. Mixtral's per-expert
    `block_sparse_moe.experts.E.w1` is `mlp.experts.E.gate_proj`; transformers 5's stacked `mlp.experts.gate_up_proj`
    (E, 2F, C) is E gate_proj and E up_proj tensors (joined again into each expert's gate_up_proj)."""
    name = key.removeprefix("model.")
    m = re.fullmatch(r"(layers\.\d+\.)block_sparse_moe\.(experts\.\d+\.)(w[123])(\.weight)", name)
    if m:
        return [(m[1] + "mlp." + m[2] + HF_EXPERT_NAMES[m[3]] + m[4], tuple(shape), None)]
    name = re.sub(r"^(layers\.\d+\.)block_sparse_moe\.gate\.", r"\1mlp.gate.", name)
    if gpt_oss:
        return gpt_oss_names(name, tuple(shape))
    m = re.fullmatch(r"(layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)", name)
    if m is None or len(shape) != 3:
        return [(name, tuple(shape), None)]
    E, N, K = shape
    if m[2] == "down_proj":
        return [(f"{m[1]}{e}.down_proj.weight", (N, K), (e, 0, N)) for e in range(E)]
    F = N // 2  # rows gate | up
    return [(f"{m[1]}{e}.{part}.weight", (F, K), (e, i * F, F)) for e in range(E) for i, part in
            enumerate(("gate_proj", "up_proj"))]


def gpt_oss_names(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple, tuple | None]]:
    """gpt-oss's names: the router is mlp.router, the sinks a bare tensor, and the experts stacked transposed, gate_up
    (E, C, 2F) with gate and up interleaved by column (gate 0::2, up 1::2), down (E, F, C), and their biases (E, 2F),
    (E, C); a pick (expert, column offset or None, transposed) names one expert's part. Released as MXFP4, its
    experts are `*_blocks` / `*_scales` (E, rows, ...) untransposed, gate and up interleaved by row: a pick ("mxfp4",
    expert, row offset or None)."""
    name = re.sub(r"\.mlp\.router\.", ".mlp.gate.", name)
    name = name + ".weight" if name.endswith("self_attn.sinks") else name
    m = re.fullmatch(r"(layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)_(blocks|scales)", name)
    if m is not None:  # MXFP4 (formats/mxfp4.py): blocks (E, rows, G, 16), read with their scales
        E, rows, cols = shape[0], shape[1], shape[2] * 32
        if m[3] == "scales":
            return []
        if m[2] == "down_proj":
            return [(f"{m[1]}{e}.down_proj.weight", (rows, cols), ("mxfp4", e, None)) for e in range(E)]
        return [(f"{m[1]}{e}.{proj}.weight", (rows // 2, cols), ("mxfp4", e, i)) for e in range(E)
                for i, proj in enumerate(("gate_proj", "up_proj"))]
    m = re.fullmatch(r"(layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)(_bias)?", name)
    if m is None:
        return [(name, shape, None)]
    kind, E, matrix = "bias" if m[3] else "weight", shape[0], not m[3]
    if m[2] == "down_proj":
        return [(f"{m[1]}{e}.down_proj.{kind}", shape[1:][::-1], (e, None, matrix)) for e in range(E)]
    part = (shape[-1] // 2,) + shape[1:-1]  # (F, C) or (F,)
    return [(f"{m[1]}{e}.{proj}.{kind}", part, (e, i, matrix)) for e in range(E)
            for i, proj in enumerate(("gate_proj", "up_proj"))]


def select(t: torch.Tensor, pick: tuple | None) -> torch.Tensor:
    """The part of a stacked expert tensor t (E, ...) that a tensor_names pick names: rows (expert, first, rows), or
    gpt-oss's (expert, column offset, transposed)."""
    if pick is None:
        return t
    if len(pick) == 3 and not isinstance(pick[2], bool):
        e, start, n = pick
        return t[e, start:start + n]
    e, offset, transposed = pick
    x = t[e] if offset is None else t[e][..., offset::2]
    return (x.T if transposed else x).contiguous()


def read_tensor(handle, key: str, pick: tuple | None, name: str, shard, full_args: ModelArgs) -> torch.Tensor:
    """The tensor `name` from a safetensors file (with a shard: only this rank's slice); pick as tensor_names."""
    if pick is None:
        return shard.read(name, handle.get_slice(key), full_args) if shard else handle.get_tensor(key)
    if pick[0] == "mxfp4":  # gpt-oss's released experts: one expert's blocks and scales, decoded
        from formats import mxfp4

        t = mxfp4.dequantize(*mxfp4.expert_codes(handle, key, pick))  # (rows, G x 32)
        return shard.take(name, t, full_args) if shard else t
    if isinstance(pick[2], bool):  # gpt-oss: one expert's whole matrix, its columns picked and transposed
        t = select(handle.get_slice(key)[pick[0]:pick[0] + 1], (0, *pick[1:]))
        return shard.take(name, t, full_args) if shard else t
    e, start, n = pick
    t = handle.get_slice(key)[e:e + 1, start:start + n][0]  # (n, K): one expert's rows of the stacked tensor
    return shard.take(name, t, full_args) if shard else t
