"""Load checkpoints into model.Transformer: Hugging Face folders or hub ids (safetensors) and GGUF files.

Loading is strict: every expected tensor present, nothing unexpected, every shape checked.
The model is built on the meta device and each tensor is read (safetensors: memory-mapped),
converted and assigned one at a time, so peak memory stays near the final weight bytes.

Quantization happens here too, tensor by tensor, so the full-precision model never exists in memory:
`load_model(..., quantize="int4:64")` quantizes each linear weight as it is read; a folder written by
`export.py` (quantization recorded in its safetensors metadata) is rebuilt with the same modules; a GGUF file's
Q4_0/Q4_1 linears load as int4 codes as they are.

Mixtral's experts are one module per expert (model.MoE), named `layers.N.mlp.experts.E.{gate,up,down}_proj`
here whatever the file's layout: the original per-expert `block_sparse_moe.experts.E.w1/w3/w2`, transformers 5's
stacked `mlp.experts.gate_up_proj` / `mlp.experts.down_proj` (E, rows, columns), or GGUF's stacked
`ffn_{gate,up,down}_exps`. A stacked tensor is read one expert at a time.
"""
import ctypes
import json
import os
import re
from dataclasses import dataclass

import torch
import torch.nn as nn
from tqdm import tqdm

from gguffile import GGUFTensor, read_gguf
from model import ModelArgs, Transformer, positive_int, positive_number
from quantize import N_MULTIPLE, Int4Linear, Int8GroupLinear, dequantize_state, mode_name, parse_mode, swap_linears

HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")

# GGUF tensor names (llama.cpp) -> ours, which are Hugging Face's without the `model.` prefix.
GGUF_TOP_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # Mixtral's router
}
GGUF_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}  # (E, N, K)
# Mixtral's original per-expert names -> ours (w1 gate, w3 up, w2 down, as the Mixtral paper's SwiGLU names them).
HF_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


# The model's fused linears and the checkpoint tensors they join, in row order (model.Attention, model.MLP).
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
PART_OF = {part: (fused, i) for fused, parts in FUSED.items() for i, part in enumerate(parts)}


def part_rows(args: ModelArgs, fused: str) -> list[int]:
    """Output rows of each checkpoint part of a fused linear."""
    if fused == "self_attn.qkv_proj":
        return [args.n_heads * args.head_dim] + [args.n_kv_heads * args.head_dim] * 2
    return [args.hidden_dim] * 2


def module_key(module: str) -> tuple[str, str]:
    """A block module's name as FUSED / PART_OF spell it, and the expert prefix it had: an expert's linears fuse
    as the dense MLP's do. 'mlp.experts.5.up_proj' -> ('mlp.up_proj', 'experts.5.'); 'mlp.up_proj' -> (.., '')."""
    m = re.match(r"mlp\.(experts\.\d+\.)", module)
    return (module, "") if m is None else ("mlp." + module[m.end():], m.group(1))


def fused_slot(name: str) -> tuple[str, str, int] | None:
    """'layers.3.self_attn.k_proj.weight' -> ('layers.3.self_attn.qkv_proj.weight', 'self_attn.qkv_proj', 1):
    the fused tensor's name, the FUSED key and the part's index; None for other names. An expert's part
    ('layers.3.mlp.experts.5.up_proj.weight') goes to its own expert's fused tensor."""
    if not name.startswith("layers."):
        return None
    _, layer, rest = name.split(".", 2)
    module, suffix = rest.rsplit(".", 1)
    key, expert = module_key(module)
    if key not in PART_OF:
        return None
    fused, i = PART_OF[key]
    return f"layers.{layer}.{fused.replace('mlp.', 'mlp.' + expert)}.{suffix}", fused, i


def row_dim(suffix: str) -> int:
    """The dimension of a linear's buffer that runs over output rows (int4 scales_and_zeros: (K/G, N, 2))."""
    return 1 if suffix == "scales_and_zeros" else 0


def join_parts(suffix: str, parts: list[torch.Tensor], rows: list[int], module: nn.Module) -> torch.Tensor:
    """One fused tensor from its parts' tensors: each cut to its rows (an int4 part is padded to 16 rows on
    disk), joined along the rows, and padded to the fused module's rows (zero codes and scales: zero weights)."""
    dim = row_dim(suffix)
    joined = torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, rows)], dim=dim)
    padded = getattr(module, "out_padded", sum(rows))
    if padded == joined.shape[dim]:
        return joined
    pad = [0, 0] * (joined.dim() - 1 - dim) + [0, padded - joined.shape[dim]]
    return nn.functional.pad(joined, pad)


def split_parts(suffix: str, t: torch.Tensor, rows: list[int], module: nn.Module) -> list[torch.Tensor]:
    """The inverse of join_parts, for writing checkpoints with the usual names: an int4 part padded to 16 rows,
    as an Int4Linear of its own shape stores it."""
    dim, out = row_dim(suffix), []
    for start, n in zip([sum(rows[:i]) for i in range(len(rows))], rows):
        part = t.narrow(dim, start, n)
        if isinstance(module, Int4Linear) and n % N_MULTIPLE:
            pad = [0, 0] * (t.dim() - 1 - dim) + [0, -n % N_MULTIPLE]
            part = nn.functional.pad(part, pad)
        out.append(part.contiguous())
    return out


def checkpoint_state(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's state dict under a checkpoint's names: each fused linear's tensors split into its parts, and
    a tied matrix once (the embedding, or the quantized head)."""
    state = {}
    for name, t in model.state_dict().items():
        if model.args.tie_embeddings and name == ("lm_head.weight" if isinstance(model.lm_head, nn.Linear)
                                                  else "embed_tokens.weight"):
            continue
        module_name, suffix = name.rsplit(".", 1)
        fused, expert = module_key(module_name.split(".", 2)[2]) if name.startswith("layers.") else ("", "")
        if fused not in FUSED:
            state[name] = t
            continue
        pieces = split_parts(suffix, t, part_rows(model.args, fused), model.get_submodule(module_name))
        layer = module_name.rsplit(".", 1)[0] + "."  # 'layers.3.mlp.' or 'layers.3.mlp.experts.5.'
        state.update({layer + part.split(".")[-1] + "." + suffix: piece for part, piece in zip(FUSED[fused], pieces)})
    return state


def checkpoint_shapes(model: Transformer) -> dict[str, tuple]:
    """The tensors a checkpoint of `model` holds, and their shapes."""
    return {name: tuple(t.shape) for name, t in checkpoint_state(model).items()}


class Joiner:
    """Collects a checkpoint's part tensors (q/k/v, gate/up) and hands over each fused tensor once all its parts
    are read; any other tensor passes straight through."""

    def __init__(self, model: Transformer):
        self.model, self.pending = model, {}

    def add(self, name: str, value):
        """(name, value) to use now: the tensor itself, a fused tensor just completed, or (None, None) while
        parts are missing. A value may be a tensor or a tuple of tensors (joined element by element)."""
        slot = fused_slot(name)
        if slot is None:
            return name, value
        fused_name, fused, i = slot
        parts = self.pending.setdefault(fused_name, {})
        parts[i] = value
        if len(parts) < len(FUSED[fused]):
            return None, None
        del self.pending[fused_name]
        ordered = [parts[j] for j in range(len(parts))]
        suffix, module = fused_name.rsplit(".", 1)[1], self.model.get_submodule(fused_name.rsplit(".", 1)[0])
        rows = part_rows(self.model.args, fused)
        if isinstance(value, tuple):  # (codes, scales, zeros) rows of a GGUF's int4 blocks: plain row joins
            return fused_name, tuple(torch.cat(xs) for xs in zip(*ordered))
        return fused_name, join_parts(suffix, ordered, rows, module)


def join_state(model: Transformer, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict under a checkpoint's names (q/k/v, gate/up apart) as `model` takes it."""
    joiner, out = Joiner(model), {}
    for name, t in state.items():
        name, t = joiner.add(name, t)
        if name is not None:
            out[name] = t
    assert not joiner.pending, f"parts without their partners: {sorted(joiner.pending)[:3]}"
    return out


def resolve_model_path(model: str) -> str:
    """A local folder or .gguf file as is; anything shaped like `org/name` that is not on disk
    is fetched from the Hugging Face hub (config, safetensors, tokenizer files only)."""
    path = os.path.expanduser(model)
    if os.path.exists(path):
        return path
    if not HUB_ID.match(model) or model.endswith((".gguf", ".safetensors")):
        raise FileNotFoundError(f"model path {model!r} does not exist")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    try:
        return snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "tokenizer.model", "*.jinja"])
    except (HfHubHTTPError, OSError, ValueError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FileNotFoundError(
            f"model {model!r} is not a local path and could not be fetched from the Hugging Face hub "
            f"({type(e).__name__}: {first_line})") from None


def load_model(model: str, device: torch.device | str, dtype: torch.dtype, progress: bool = False,
               quantize: str | None = None, quantize_head: bool = False, shard=None) -> tuple[Transformer, str]:
    """Load `model` (HF folder, hub id or .gguf file) onto device in dtype; returns (model, local path).
    quantize ('int8', 'int4', 'int4:GROUP') quantizes the linear layers (and the head with quantize_head)
    while loading; None loads the checkpoint as it is: a quantized folder as saved, a GGUF file's Q4_0/Q4_1
    linears as int4:32 codes (gguf_native_mode), anything else in dtype; 'none' dequantizes a GGUF file's
    quantized tensors too. A quantized folder cannot be re-quantized: a different `quantize` for it is an error.
    shard (a tp.Shard) loads only this rank's slices into its smaller model (safetensors: only those bytes
    are read), ready for tp.install."""
    if quantize not in (None, "none"):
        parse_mode(quantize)  # a bad mode fails before any reading
    elif quantize_head:
        raise ValueError("quantize_head (--quantize-head) needs a quantization mode (--quantize)")
    path = resolve_model_path(model)
    if os.path.isdir(path):
        return load_hf_folder(path, device, dtype, progress, quantize, quantize_head, shard), path
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ValueError(f"cannot read {path!r}: {e.strerror or e}") from None
    if magic != b"GGUF":
        raise ValueError(f"{path!r} is neither a Hugging Face model folder nor a GGUF file")
    return load_gguf(path, device, dtype, progress, quantize, quantize_head, shard), path


def release_freed_memory() -> None:
    """Hand freed heap memory back to the OS: glibc keeps the per-tensor temporaries (float32 copies, quantization
    intermediates) fragmented, so without this the peak RSS of a load grows with every tensor. A no-op off glibc."""
    libc = ctypes.CDLL(None)
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def check_tensors(expected: dict[str, tuple], found: dict[str, tuple], source: str) -> None:
    """Strict loading: raise a ValueError naming any missing, unexpected or mis-shaped tensor."""
    missing = sorted(expected.keys() - found.keys())
    unexpected = sorted(found.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(f"{source}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
                         f"unexpected tensors {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    for name, shape in expected.items():
        if tuple(found[name]) != tuple(shape):
            raise ValueError(f"{source}: tensor {name} has shape {tuple(found[name])}, expected {tuple(shape)}")


SAFETENSORS_FLOATS = ("F64", "F32", "F16", "BF16")  # what a float weight may be stored as: it is cast to the dtype
SAFETENSORS_INTS = {torch.int8: "I8", torch.uint8: "U8"}  # quantized codes: int8, and int4 packed in bytes


def check_dtypes(model: Transformer, found: dict[str, str], source: str) -> None:
    """A ValueError naming a tensor whose safetensors dtype (found: name -> "F32", "I8", ...) the model cannot take:
    a float weight stored as integers or bool, or quantized codes not in the integer type they were saved in."""
    for name, t in checkpoint_state(model).items():
        want = SAFETENSORS_FLOATS if t.is_floating_point() else (SAFETENSORS_INTS[t.dtype],)
        if found[name] not in want:
            raise ValueError(f"{source}: tensor {name} is stored as {found[name]}, expected {' or '.join(want)}")


def assign_weights(model: Transformer, state: dict[str, torch.Tensor], device,
                   quantized: frozenset[str] = frozenset()) -> Transformer:
    """Assign loaded tensors to a meta-device model, tie the head if asked, build the RoPE tables.
    `quantized` names the modules quantize-at-load already filled (quantizer); every other tensor must be
    in state. A quantized head of a tied model is the one stored matrix; the embedding is its dequantized copy."""
    tied_float = model.args.tie_embeddings and isinstance(model.lm_head, nn.Linear)
    if tied_float:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    elif model.args.tie_embeddings and "embed_tokens.weight" not in state:  # a saved quantized tied head
        dtype = state["norm.weight"].dtype  # the model dtype
        state["embed_tokens.weight"] = dequantize_state(model.lm_head, state, "lm_head.").to(dtype)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if k.rpartition(".")[0] not in quantized]
    assert not missing and not unexpected, f"loader bug: missing {missing[:3]}, unexpected {unexpected[:3]}"
    if tied_float:
        model.lm_head.weight = model.embed_tokens.weight  # assign made two Parameters; make it one again
    model.reset_rope(device)
    return model.eval().requires_grad_(False)


def quantizer(model: Transformer, quantize: str | None, quantize_head: bool):
    """Swap a meta model's linears for quantized ones. Returns (convert, filled): convert(name, float tensor)
    casts a tensor into {name: tensor} for the state dict, except a quantized linear's weight, which it
    quantizes straight into its module (packed for the kernel at once: no plain copies pile up) and whose
    module name it adds to `filled`."""
    targets, filled = {}, set()
    if quantize is not None:
        targets = {f"{name}.weight": (name, module)
                   for name, module in swap_linears(model, quantize, quantize_head).items()}
        if quantize_head and model.args.tie_embeddings:  # the checkpoint's one matrix feeds the quantized head
            targets["embed_tokens.weight"] = targets.pop("lm_head.weight")

    def convert(name: str, w: torch.Tensor, device, dtype) -> dict[str, torch.Tensor]:
        if name not in targets:
            return {name: w.to(device=device, dtype=dtype)}
        prefix, module = targets[name]
        buffers = module.quantize_weight(w.to(device))  # plain layout, as checkpoints store it
        tied_head = {}
        if name == "embed_tokens.weight":  # a quantized tied head: the embedding is its dequantized copy
            tied_head = {name: dequantize_state(module, buffers, "").to(dtype)}
        module.load_state_dict(buffers, assign=True)
        filled.add(prefix)
        return tied_head

    return convert, filled


def checkpoint_quantization(path: str, files: list[str], quantize: str | None, quantize_head: bool):
    """The (mode, quantize_head) a quantized folder was saved with, from its safetensors metadata, or None;
    a `quantize` request that differs from it is an error (the checkpoint's codes cannot be re-quantized)."""
    try:
        meta = read_quantization(os.path.join(path, files[0]))
    except Exception as e:  # safetensors raises its own error types for corrupt or truncated files
        raise ValueError(f"cannot read safetensors file {os.path.join(path, files[0])!r}: {e}") from None
    if meta is None:
        return None
    saved = mode_name(*parse_mode(meta["quantization"] + (f":{meta['group_size']}" if meta["group_size"] else "")))
    saved_head = meta["quantize_head"] == "true"
    requested = None if quantize is None else "none" if quantize == "none" else mode_name(*parse_mode(quantize))
    if requested is not None and (requested, quantize_head) != (saved, saved_head):
        raise ValueError(f"{path!r} is quantized as {saved}{' with the head' if saved_head else ''}; "
                         f"requested {quantize}{' with the head' if quantize_head else ''}: drop --quantize "
                         "to load it as saved, or quantize from the original weights")
    return saved, saved_head


def read_quantization(file: str) -> dict[str, str] | None:
    """The quantization entries of a safetensors file's metadata, or None if it is not quantized."""
    from safetensors import safe_open

    with safe_open(file, framework="pt") as f:
        meta = f.metadata() or {}
    return {k: meta[k] for k in ("quantization", "group_size", "quantize_head")} if "quantization" in meta else None


def hf_tensor_names(key: str, shape: tuple[int, ...]) -> list[tuple[str, tuple, tuple | None]]:
    """The tensors a safetensors key holds, under our checkpoint names: [(name, shape, pick)], pick None for the
    tensor itself or (expert, first row, rows) of a stacked (E, N, K) expert tensor. Mixtral's per-expert
    `block_sparse_moe.experts.E.w1` is `mlp.experts.E.gate_proj`; transformers 5's stacked `mlp.experts.gate_up_proj`
    (E, 2F, C) is E gate_proj and E up_proj tensors (joined again into each expert's gate_up_proj)."""
    name = key.removeprefix("model.")
    m = re.fullmatch(r"(layers\.\d+\.)block_sparse_moe\.(experts\.\d+\.)(w[123])(\.weight)", name)
    if m:
        return [(m[1] + "mlp." + m[2] + HF_EXPERT_NAMES[m[3]] + m[4], tuple(shape), None)]
    name = re.sub(r"^(layers\.\d+\.)block_sparse_moe\.gate\.", r"\1mlp.gate.", name)
    m = re.fullmatch(r"(layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)", name)
    if m is None or len(shape) != 3:
        return [(name, tuple(shape), None)]
    E, N, K = shape
    if m[2] == "down_proj":
        return [(f"{m[1]}{e}.down_proj.weight", (N, K), (e, 0, N)) for e in range(E)]
    F = N // 2  # rows gate | up
    return [(f"{m[1]}{e}.{part}.weight", (F, K), (e, i * F, F)) for e in range(E) for i, part in
            enumerate(("gate_proj", "up_proj"))]


def read_hf_tensor(handle, key: str, pick: tuple | None, name: str, shard, full_args: ModelArgs) -> torch.Tensor:
    """The tensor `name` from a safetensors file (with a shard: only this rank's slice); pick as hf_tensor_names."""
    if pick is None:
        return shard.read(name, handle.get_slice(key), full_args) if shard else handle.get_tensor(key)
    e, start, n = pick
    t = handle.get_slice(key)[e:e + 1, start:start + n][0]  # (n, K): one expert's rows of the stacked tensor
    return shard.take(name, t, full_args) if shard else t


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


GENERATION_SAMPLING = ("temperature", "top_k", "top_p", "repetition_penalty")  # what generation_config.json may set


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


def load_hf_folder(path: str, device, dtype: torch.dtype, progress: bool = False,
                   quantize: str | None = None, quantize_head: bool = False, shard=None) -> Transformer:
    """A Hugging Face folder: config.json plus model.safetensors or a sharded index;
    a folder export.py wrote is rebuilt with its quantized modules."""
    from safetensors import safe_open

    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"no config.json in model folder {path!r}")
    full_args = ModelArgs.from_hf_config(read_json(config_file))
    args = shard.args(full_args) if shard else full_args
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
    saved = checkpoint_quantization(path, files, quantize, quantize_head)
    if saved is not None and shard is not None:
        raise ValueError(f"{path!r} is a quantized checkpoint, which tensor parallel cannot slice; load the "
                         "original weights with --quantize instead")

    with torch.device("meta"):
        model = Transformer(args)
    if saved is not None:  # build the saved modules first: the file holds their buffers
        swap_linears(model, *saved)
        quantize, quantize_head = None, False
    handles, found = {}, {}
    for file in files:
        full = os.path.join(path, file)
        try:
            handles[file] = safe_open(full, framework="pt", device="cpu")
            for key in handles[file].keys():
                part = handles[file].get_slice(key)
                for name, shape, pick in hf_tensor_names(key, part.get_shape()):
                    found[name] = (file, key, shape, pick, part.get_dtype())
        except Exception as e:  # safetensors raises its own error types for corrupt or truncated files
            raise ValueError(f"cannot read safetensors file {full!r}: {e}") from None
    shapes = {k: shard.local_shape(k, v[2], full_args) if shard else v[2] for k, v in found.items()}
    check_tensors(checkpoint_shapes(model), shapes, path)
    check_dtypes(model, {k: v[4] for k, v in found.items()}, path)
    convert, filled = quantizer(model, None if quantize == "none" else quantize, quantize_head)

    state, joiner = {}, Joiner(model)
    for name, (file, key, _, pick, _) in tqdm(found.items(), desc="loading", disable=not progress, unit="tensor"):
        try:
            t = read_hf_tensor(handles[file], key, pick, name, shard, full_args)
        except Exception as e:
            raise ValueError(f"cannot read tensor {key!r} from {file!r}: {e}") from None
        name, t = joiner.add(name, t)  # q/k/v and gate/up parts become one tensor
        if name is None:
            continue
        if not t.is_floating_point():  # quantized codes keep their integer dtype
            state[name] = t.to(device)
        else:
            state.update(convert(name, t, device, dtype))
        release_freed_memory()
    return assign_weights(model, state, device, frozenset(filled))


def gguf_args(meta: dict, tensors: list[GGUFTensor]) -> ModelArgs:
    """ModelArgs from GGUF metadata (llama architecture only); a missing or mistyped key is a ValueError naming it."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: 'llama'")
    missing = [k for k in ("attention.head_count", "embedding_length", "block_count", "feed_forward_length")
               if f"llama.{k}" not in meta]
    if "llama.vocab_size" not in meta and "tokenizer.ggml.tokens" not in meta:
        missing.append("vocab_size")
    if missing:
        raise ValueError(f"GGUF metadata has no {', '.join('llama.' + k for k in missing)}")

    def size(key: str, default: int | None = None) -> int:
        return positive_int(meta.get(f"llama.{key}", default), f"GGUF metadata llama.{key}")

    def number(key: str, default: float) -> float:
        return positive_number(meta.get(f"llama.{key}", default), f"GGUF metadata llama.{key}")

    scaling_type = meta.get("llama.rope.scaling.type", "none")
    if scaling_type not in ("none", "linear"):
        raise ValueError(f"unsupported GGUF rope scaling {scaling_type!r}; supported: 'none', 'linear'")
    rope_scaling = None
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": number("rope.scaling.factor", None)}
    n_heads = size("attention.head_count")
    n_experts = size("expert_count") if meta.get("llama.expert_count", 0) != 0 else None  # Mixtral: > 0
    args = ModelArgs(
        vocab_size=size("vocab_size", len(meta.get("tokenizer.ggml.tokens", ()))),
        dim=size("embedding_length"),
        n_layers=size("block_count"),
        n_heads=n_heads,
        hidden_dim=size("feed_forward_length"),
        n_kv_heads=size("attention.head_count_kv", n_heads),
        head_dim=size("attention.key_length") if "llama.attention.key_length" in meta else None,
        norm_eps=number("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=number("rope.freq_base", 10000.0),
        rope_scaling=rope_scaling,
        max_seq_len=size("context_length", 4096),
        tie_embeddings="output.weight" not in {t.name for t in tensors},  # llama.cpp drops the head of tied models
        n_experts=n_experts,
        n_experts_per_token=size("expert_used_count", 2) if n_experts else 2,
    )
    if meta.get("llama.rope.dimension_count", args.head_dim) != args.head_dim:
        raise ValueError("unsupported GGUF: partial rotary embeddings (rope.dimension_count != head dim)")
    return args


@dataclass
class ExpertSlice:
    """One expert's (N, K) matrix of a GGUF tensor that stacks all E experts, read as gguf_int4 and
    gguf_dequantize read a file tensor (gguffile.GGUFTensor): its data rows and block type."""
    data: object  # numpy rows (N, K) or (N, bytes per row) of one expert
    tensor_type: object


def gguf_tensors(file_tensors: list[GGUFTensor]) -> tuple[dict, dict[str, tuple]]:
    """The file's tensors under our names ({name: GGUFTensor or ExpertSlice}) and their torch shapes: a stacked
    `blk.3.ffn_up_exps.weight` (E, F, C) is E tensors `layers.3.mlp.experts.E.up_proj.weight` (F, C)."""
    tensors, shapes = {}, {}
    for t in file_tensors:
        shape = t.shape
        parts = t.name.split(".")
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in GGUF_EXPERT_NAMES and len(shape) == 3:
            for e in range(shape[0]):
                name = f"layers.{parts[1]}.mlp.experts.{e}.{GGUF_EXPERT_NAMES[parts[2]]}.{parts[3]}"
                tensors[name], shapes[name] = ExpertSlice(t.data[e], t.tensor_type), shape[1:]
            continue
        name = gguf_tensor_name(t.name)
        tensors[name], shapes[name] = t, shape
    return tensors, shapes


def gguf_tensor_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `layers.3.self_attn.q_proj.weight`; unknown names pass through (and fail the check).
    Mixtral GGUFs from before llama.cpp stacked the experts name each one: `blk.3.ffn_up.5.weight`."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in GGUF_BLOCK_NAMES:
        return f"layers.{parts[1]}.{GGUF_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    if parts[0] == "blk" and len(parts) == 5 and parts[2] in ("ffn_gate", "ffn_up", "ffn_down") and parts[3].isdigit():
        return f"layers.{parts[1]}.mlp.experts.{parts[3]}.{parts[2].removeprefix('ffn_')}_proj.{parts[4]}"
    if len(parts) == 2 and parts[0] in GGUF_TOP_NAMES:
        return f"{GGUF_TOP_NAMES[parts[0]]}.{parts[1]}"
    return gguf_name


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp stores q/k rows with RoPE pairs interleaved (2i, 2i+1); our RoPE pairs (i, i + D/2).
    Its converter reshaped each head's rows as (2, D/2) -> (D/2, 2); this is the inverse."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


GGUF_INT4 = ("Q4_0", "Q4_1")  # llama.cpp block types whose codes Int4Linear (group 32) takes as they are


def gguf_native_mode(tensors: dict, quantize: str | None) -> str | None:
    """The quantization the file's linear weights already have, when our modules can take their codes as they are:
    "int4:32" when every block linear is Q4_0 or Q4_1 (llama.cpp's 4-bit blocks of 32). Used unless `quantize`
    asks for something else ("none": dequantize everything, as before)."""
    linears = [t.tensor_type.name for name, t in tensors.items() if name.startswith("layers.") and "_proj." in name]
    native = "int4:32" if linears and all(kind in GGUF_INT4 for kind in linears) else None
    if quantize is None or (native is not None and quantize != "none" and mode_name(*parse_mode(quantize)) == native):
        return native
    return None


def gguf_int4(t, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0/Q4_1 tensor's codes (N, K) uint8 in [0, 15] and per-block scale and zero (N, K/32) float32, in our
    int4 scheme w = (q - 8) * scale + zero. Q4_1 stores d and m with w = d * q + m: scale d, zero m + 8d; Q4_0 is
    w = d * (q - 8): zero 0. A block's 16 bytes hold weights j (low nibble) and j + 16 (high nibble)."""
    N, K = shape
    raw = torch.from_numpy(t.data.copy()).view(N, K // 32, -1)  # (N, blocks, bytes per block)
    d = raw[..., 0:2].contiguous().view(torch.float16).float()[..., 0]  # (N, K/32)
    if t.tensor_type.name == "Q4_1":
        m, qs = raw[..., 2:4].contiguous().view(torch.float16).float()[..., 0], raw[..., 4:20]
        zeros = m + 8 * d
    else:
        qs, zeros = raw[..., 2:18], torch.zeros_like(d)
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1).view(N, K)  # (N, K/32, 16) x 2 -> (N, K)
    return codes, d, zeros


def gguf_q8_0(t, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor's codes (N, K) int8 and per-block scale d (N, K/32) float32: w = d * q. A block is d (float16)
    and 32 int8 codes."""
    N, K = shape
    raw = torch.from_numpy(t.data.copy()).view(N, K // 32, 34)  # (N, blocks, bytes per block)
    d = raw[..., 0:2].contiguous().view(torch.float16).float()[..., 0]  # (N, K/32)
    return raw[..., 2:].contiguous().view(torch.int8).reshape(N, K), d


def gguf_dequantize(t, shape: tuple[int, ...], rows: int = 4096) -> torch.Tensor:
    """A GGUF tensor as float32, dequantized `rows` rows at a time: numpy's temporaries for a large
    embedding would otherwise be several times its size, and set the peak memory of the whole load."""
    import gguf

    out = torch.empty(shape, dtype=torch.float32)
    flat = out.view(shape[0], -1)  # (rows, ...) -> 2-D; the file's data has one row per torch row
    for i in range(0, shape[0], rows):
        block = gguf.quants.dequantize(t.data[i:i + rows], t.tensor_type)  # may be a read-only memory-map view
        flat[i:i + rows] = torch.from_numpy(block.reshape(flat[i:i + rows].shape).copy())
    return out


def load_gguf(path: str, device, dtype: torch.dtype, progress: bool = False,
              quantize: str | None = None, quantize_head: bool = False, shard=None) -> Transformer:
    """A llama-architecture GGUF file, dequantized to dtype with the gguf package (or, with quantize, from
    float32 straight to int8/int4 codes)."""
    import gguf

    try:
        meta, file_tensors = read_gguf(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"cannot read GGUF file {path!r}: {e}") from None
    full_args = gguf_args(meta, file_tensors)
    tensors, full_shapes = gguf_tensors(file_tensors)
    rope_freqs = tensors.pop("rope_freqs.weight", None)  # Llama 3.1 GGUFs: per-frequency rope divisors
    full_shapes.pop("rope_freqs.weight", None)
    if rope_freqs is not None:
        if rope_freqs.tensor_type.name != "F32" or rope_freqs.shape != (full_args.head_dim // 2,):
            raise ValueError(f"{path!r}: rope_freqs.weight is {rope_freqs.tensor_type.name} {rope_freqs.shape}, "
                             f"expected F32 ({full_args.head_dim // 2},)")
        full_args.rope_freq_factors = tuple(float(x) for x in rope_freqs.data)
    args = shard.args(full_args) if shard else full_args
    with torch.device("meta"):
        model = Transformer(args)
    shapes = {k: shard.local_shape(k, v, full_args) for k, v in full_shapes.items()} if shard else full_shapes
    check_tensors(checkpoint_shapes(model), shapes, path)
    head_name = "lm_head.weight" if "lm_head.weight" in tensors else "embed_tokens.weight"  # tied: the embedding
    # Without --quantize, a Q8_0 head runs as the file's codes (Int8GroupLinear, below), in a float32 model too: the
    # kernel rounds the head's input to bf16, which costs SmolLM2 less than a bf16 model does (KL 5.1e-4 against
    # 2.2e-4 with a float32 head, top-1 unchanged; README, Quantization), and the head is then exact whatever the
    # row count, as a float32 matmul is not (greedy speculative == plain greedy, README, Exactness).
    q8_0_head = quantize is None and shard is None and tensors[head_name].tensor_type.name == "Q8_0"
    del meta  # the vocabulary's ~100k strings are not needed any more
    # A shard slices dequantized tensors; a quantized head is quantized from the dequantized embedding.
    native = None if shard or quantize_head else gguf_native_mode(tensors, quantize)
    if native is not None:  # the file's 4-bit codes, as they are
        modules = {f"{name}.weight": (name, m) for name, m in swap_linears(model, native).items()}
        quantize, quantize_head = None, False
    convert, filled = quantizer(model, None if quantize == "none" else quantize, quantize_head)
    if q8_0_head:
        # The file's Q8_0 head as it is (Int8GroupLinear): the largest matrix of a small model, read every step in
        # 1.25 bytes a weight instead of bf16's 2. A tied embedding keeps its dequantized copy for the lookup.
        model.lm_head = Int8GroupLinear(args.dim, args.vocab_size, device="meta")  # load_codes assigns its buffers
        filled.add("lm_head.halves")

    state, joiner = {}, Joiner(model)
    for name, t in tqdm(tensors.items(), desc="loading", disable=not progress, unit="tensor"):
        shape = full_shapes[name]
        if q8_0_head and name == head_name:
            model.lm_head.load_codes(*(x.to(device) for x in gguf_q8_0(t, shape)))
            if name == "lm_head.weight":  # untied: nothing else reads it
                continue
        heads = full_args.n_heads if "q_proj" in name else full_args.n_kv_heads
        if native is not None and t.tensor_type.name in GGUF_INT4 and "_proj." in name:
            codes, scales, zeros = gguf_int4(t, shape)
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                codes, scales, zeros = (unpermute_qk(x, heads) for x in (codes, scales, zeros))
            name, blocks = joiner.add(name, (codes, scales, zeros))
            if name is not None:
                prefix, module = modules[name]
                buffers = module.buffers_for_codes(*blocks)
                module.load_state_dict({k: v.to(device) for k, v in buffers.items()}, assign=True)
                filled.add(prefix)
            continue
        try:
            w = gguf_dequantize(t, shape)
        except (NotImplementedError, ValueError) as e:  # gguf.quants: a block type it cannot dequantize
            raise ValueError(f"cannot dequantize GGUF tensor {name!r} ({t.tensor_type.name}): {e}") from None
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            w = unpermute_qk(w, heads)
        if shard:
            w = shard.take(name, w, full_args)  # a GGUF block packs whole rows: dequantize, then slice
        name, w = joiner.add(name, w)
        if name is not None:
            state.update(convert(name, w, device, dtype))
        release_freed_memory()
    return assign_weights(model, state, device, frozenset(filled))
