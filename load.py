"""Load checkpoints into model.Transformer: Hugging Face folders or hub ids (safetensors) and GGUF files.

Loading is strict: every expected tensor present, nothing unexpected, every shape checked.
The model is built on the meta device and each tensor is read (safetensors: memory-mapped),
converted and assigned one at a time, so peak memory stays near the final weight bytes.
"""
import json
import os
import re

import torch
from tqdm import tqdm

from model import ModelArgs, Transformer

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
}


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


def load_model(model: str, device: torch.device | str, dtype: torch.dtype,
               progress: bool = False) -> tuple[Transformer, str]:
    """Load `model` (HF folder, hub id or .gguf file) onto device in dtype; returns (model, local path)."""
    path = resolve_model_path(model)
    if os.path.isdir(path):
        return load_hf_folder(path, device, dtype, progress), path
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path!r} is neither a Hugging Face model folder nor a GGUF file")
    return load_gguf(path, device, dtype, progress), path


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


def assign_weights(model: Transformer, state: dict[str, torch.Tensor], device) -> Transformer:
    """Assign loaded tensors to a meta-device model, tie the head if asked, build the RoPE tables."""
    if model.args.tie_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if model.args.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight  # assign made two Parameters; make it one again
    model.reset_rope(device)
    return model.eval().requires_grad_(False)


def expected_shapes(model: Transformer) -> dict[str, tuple]:
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if model.args.tie_embeddings:
        del shapes["lm_head.weight"]  # tied checkpoints store only the embedding
    return shapes


def read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def load_hf_folder(path: str, device, dtype: torch.dtype, progress: bool = False) -> Transformer:
    """A Hugging Face folder: config.json plus model.safetensors or a sharded index."""
    from safetensors import safe_open

    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"no config.json in model folder {path!r}")
    args = ModelArgs.from_hf_config(read_json(config_file))
    index_file = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_file):
        weight_map = read_json(index_file)["weight_map"]  # tensor name -> shard file
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path!r}")

    with torch.device("meta"):
        model = Transformer(args)
    handles, found = {}, {}
    for file in files:
        full = os.path.join(path, file)
        if not os.path.isfile(full):
            raise FileNotFoundError(f"safetensors shard {full!r} listed in the index is missing")
        try:
            handles[file] = safe_open(full, framework="pt", device="cpu")
            for key in handles[file].keys():
                found[key.removeprefix("model.")] = (file, key, handles[file].get_slice(key).get_shape())
        except Exception as e:  # safetensors raises its own error types for corrupt or truncated files
            raise ValueError(f"cannot read safetensors file {full!r}: {e}") from None
    check_tensors(expected_shapes(model), {k: v[2] for k, v in found.items()}, path)

    state = {}
    for name, (file, key, _) in tqdm(found.items(), desc="loading", disable=not progress, unit="tensor"):
        try:
            state[name] = handles[file].get_tensor(key).to(device=device, dtype=dtype)
        except Exception as e:
            raise ValueError(f"cannot read tensor {key!r} from {file!r}: {e}") from None
    return assign_weights(model, state, device)


def gguf_value(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_args(reader) -> ModelArgs:
    """ModelArgs from GGUF metadata (llama architecture only)."""
    arch = gguf_value(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: 'llama'")
    names = {t.name for t in reader.tensors}
    n_heads = gguf_value(reader, "llama.attention.head_count")
    dim = gguf_value(reader, "llama.embedding_length")
    head_dim = gguf_value(reader, "llama.attention.key_length", dim // n_heads)
    if gguf_value(reader, "llama.rope.dimension_count", head_dim) != head_dim:
        raise ValueError("unsupported GGUF: partial rotary embeddings (rope.dimension_count != head dim)")
    scaling_type = gguf_value(reader, "llama.rope.scaling.type", "none")
    if scaling_type not in ("none", "linear"):
        raise ValueError(f"unsupported GGUF rope scaling {scaling_type!r}; supported: 'none', 'linear'")
    rope_scaling = None
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": gguf_value(reader, "llama.rope.scaling.factor")}
    vocab = gguf_value(reader, "llama.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    return ModelArgs(
        vocab_size=vocab,
        dim=dim,
        n_layers=gguf_value(reader, "llama.block_count"),
        n_heads=n_heads,
        hidden_dim=gguf_value(reader, "llama.feed_forward_length"),
        n_kv_heads=gguf_value(reader, "llama.attention.head_count_kv", n_heads),
        head_dim=head_dim,
        norm_eps=gguf_value(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=gguf_value(reader, "llama.rope.freq_base", 10000.0),
        rope_scaling=rope_scaling,
        max_seq_len=gguf_value(reader, "llama.context_length", 4096),
        tie_embeddings="output.weight" not in names,  # llama.cpp drops the head of tied models
    )


def gguf_tensor_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `layers.3.self_attn.q_proj.weight`; unknown names pass through (and fail the check)."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in GGUF_BLOCK_NAMES:
        return f"layers.{parts[1]}.{GGUF_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in GGUF_TOP_NAMES:
        return f"{GGUF_TOP_NAMES[parts[0]]}.{parts[1]}"
    return gguf_name


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp stores q/k rows with RoPE pairs interleaved (2i, 2i+1); our RoPE pairs (i, i + D/2).
    Its converter reshaped each head's rows as (2, D/2) -> (D/2, 2); this is the inverse."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def load_gguf(path: str, device, dtype: torch.dtype, progress: bool = False) -> Transformer:
    """A llama-architecture GGUF file, dequantized to dtype with the gguf package."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"cannot read GGUF file {path!r}: {e}") from None
    args = gguf_args(reader)
    tensors = {gguf_tensor_name(t.name): t for t in reader.tensors}
    rope_freqs = tensors.pop("rope_freqs.weight", None)  # Llama 3.1 GGUFs: per-frequency rope divisors
    if rope_freqs is not None:
        args.rope_freq_factors = tuple(float(x) for x in rope_freqs.data)
    with torch.device("meta"):
        model = Transformer(args)
    # GGUF lists dimensions fastest-first; torch shapes are the reverse.
    check_tensors(expected_shapes(model), {k: tuple(reversed(t.shape.tolist())) for k, t in tensors.items()}, path)

    state = {}
    for name, t in tqdm(tensors.items(), desc="dequantizing", disable=not progress, unit="tensor"):
        shape = tuple(reversed(t.shape.tolist()))
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        if not w.flags.writeable:  # float tensors come straight from the read-only memory map
            w = w.copy()
        w = torch.from_numpy(w)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            w = unpermute_qk(w, args.n_heads if "q_proj" in name else args.n_kv_heads)
        state[name] = w.to(device=device, dtype=dtype)
    return assign_weights(model, state, device)
