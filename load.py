"""Load checkpoints into model.Transformer: Hugging Face folders or hub ids (safetensors) and GGUF files.

Each loader builds the model on the meta device, checks the file's names and shapes against it, and hands every
tensor, as it is read (safetensors: memory-mapped), to a checkpoint.Filler, which assigns it and checks at the end
that everything came (strict loading; the names and the filling are checkpoint.py's). One route per tensor is
decided here: read as a float, quantized as it is read, or taken as the file's own codes.

Quantization happens here too, tensor by tensor, so the full-precision model never exists in memory:
`load_model(..., quantize="int4:64")` quantizes each linear weight as it is read; a folder written by
`export.py` (quantization recorded in its safetensors metadata) is rebuilt with the same modules; a GGUF file's
Q4_0/Q4_1/Q4_K linears load as int4 codes as they are (the format itself is gguffile.py's).

Mixtral's experts are one module per expert (model.MoE), named `layers.N.mlp.experts.E.{gate,up,down}_proj`
here whatever the file's layout: the original per-expert `block_sparse_moe.experts.E.w1/w3/w2`, transformers 5's
stacked `mlp.experts.gate_up_proj` / `mlp.experts.down_proj` (E, rows, columns), or GGUF's stacked
`ffn_{gate,up,down}_exps`. A stacked tensor is read one expert at a time.
"""
import ctypes
import dataclasses
import os
import re
from dataclasses import dataclass

import torch
import torch.nn as nn
from tqdm import tqdm

from formats import gguffile
from formats import hffolder
from formats import hfquant
from formats import mxfp4
from formats import weightcache
from formats.checkpoint import Filler, check_tensors, checkpoint_shapes, checkpoint_state
from config import ModelArgs
from model import Transformer
from models.families import build_model
from quantize import Int4Linear, Int8GroupLinear, make_quantized_linear, mode_name, parse_mode, swap_linears

HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
HF_REPO = re.compile(r"^([\w.-]+/[\w.-]+)(?::([\w.-]+))?$")  # --hf-repo: ORG/NAME[:QUANT], llama.cpp's -hf
DEFAULT_GGUF_QUANT = "Q4_K_M"  # the file llama.cpp's -hf takes from a GGUF repository when no QUANT is named
FOLDER_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja"]  # what a model folder is fetched with


@dataclass(frozen=True)
class Quantization:
    """load_model's quantize and quantize_head, decoded once. mode: what float linears are quantized into as they
    are read ("int8", "int4:G"; None: they stay float); head: the LM head too; as_stored: no `quantize` at all, so
    a file's own codes load as they are (a quantized folder; a GGUF's Q4_0/Q4_1/Q4_K linears and Q8_0 head)."""
    mode: str | None = None
    head: bool = False
    as_stored: bool = True

    @classmethod
    def parse(cls, quantize: str | None, quantize_head: bool) -> "Quantization":
        """A bad mode, or a head to quantize without a mode, is a ValueError before any reading."""
        if quantize_head and quantize in (None, "none"):
            raise ValueError("quantize_head (--quantize-head) needs a quantization mode (--quantize)")
        mode = None if quantize in (None, "none") else mode_name(*parse_mode(quantize))
        return cls(mode, quantize_head, quantize is None)


def resolve_model_path(model: str, hub: bool = False) -> str:
    """A local folder or .gguf file as is; anything shaped like `org/name` that is not on disk is fetched from the
    Hugging Face hub (config, safetensors, tokenizer files only). hub: `model` is --hf-repo's (fetch_hf_repo)."""
    if hub:
        return fetch_hf_repo(model)
    path = os.path.expanduser(model)
    if os.path.exists(path):
        return path
    if not HUB_ID.match(model) or model.endswith((".gguf", ".safetensors")):
        raise FileNotFoundError(f"model path {model!r} does not exist")
    return hub_download(model, FOLDER_FILES, "is not a local path and could not be fetched")


def fetch_hf_repo(value: str) -> str:
    """--hf-repo ORG/NAME[:QUANT], as llama.cpp's -hf, always from the hub: a model folder's files (config.json,
    safetensors), or else a GGUF repository's one .gguf file of QUANT (default DEFAULT_GGUF_QUANT)."""
    match = HF_REPO.match(value)
    if match is None:
        raise ValueError(f"--hf-repo takes a Hugging Face hub id ORG/NAME or ORG/NAME:QUANT, got {value!r}")
    repo, quant = match.groups()
    if quant is None:
        folder = hub_download(repo, FOLDER_FILES)
        if os.path.isfile(os.path.join(folder, "config.json")):
            return folder
    quant = quant or DEFAULT_GGUF_QUANT
    folder = hub_download(repo, [f"*{quant.upper()}*.gguf", f"*{quant.lower()}*.gguf"])
    # The cache's snapshot folder also holds what earlier fetches of the repository brought (other quants)
    files = sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, names in os.walk(folder) for f in names
                   if f.endswith(".gguf") and quant.lower() in f.lower())
    if len(files) != 1:
        found, then = (f"{len(files)} .gguf files of {quant} ({', '.join(files[:4])})", "download the one to load "
                       "(a split one merged: llama-gguf-split --merge) for --model") if files else \
            (f"no .gguf file of {quant}", f"name another quantization, -hf {repo}:QUANT")
        found = found if match[2] else f"no config.json and {found}"
        raise FileNotFoundError(f"{repo!r} on the Hugging Face hub has {found}; {then}")
    return os.path.join(folder, files[0])


def hub_download(repo: str, patterns: list[str], why: str = "could not be fetched") -> str:
    """The local folder of `repo`'s files matching `patterns` (fetched, or from the hub cache); a one-line
    FileNotFoundError (`why`) when the hub cannot be reached or has no such repository."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    try:
        return snapshot_download(repo, allow_patterns=patterns)
    except (HfHubHTTPError, OSError, ValueError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FileNotFoundError(f"model {repo!r} {why} from the Hugging Face hub ({type(e).__name__}: "
                                f"{first_line})") from None


def load_model(model: str, device: torch.device | str, dtype: torch.dtype, progress: bool = False,
               quantize: str | None = None, quantize_head: bool = False, shard=None,
               cache_dir: str | None = None) -> tuple[Transformer, str]:
    """Load `model` (HF folder, hub id or .gguf file) onto device in dtype; returns (model, local path).
    quantize ('int8', 'int4', 'int4:GROUP') quantizes the linear layers (and the head with quantize_head)
    while loading; None loads the checkpoint as it is: a quantized folder as saved, a GGUF file's Q4_0/Q4_1/Q4_K
    linears as int4:32 codes (GGUFRoutes), anything else in dtype; 'none' dequantizes a GGUF file's
    quantized tensors too. A quantized folder cannot be re-quantized: a different `quantize` for it is an error.
    shard (a tp.Shard) loads only this rank's slices into its smaller model (a GGUF's codes sliced as codes;
    where a slice is rows, only its bytes are read), ready for tp.install. cache_dir: a GGUF file loaded onto the
    CPU whole reads its converted tensors from there when an earlier load wrote them, else writes them
    (weightcache.py); None converts every time."""
    request = Quantization.parse(quantize, quantize_head)
    path = resolve_model_path(model)
    if os.path.isdir(path):
        return load_hf_folder(path, device, dtype, progress, request, shard), path
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ValueError(f"cannot read {path!r}: {e.strerror or e}") from None
    if magic != b"GGUF":
        raise ValueError(f"{path!r} is neither a Hugging Face model folder nor a GGUF file")
    return load_gguf(path, torch.device(device), dtype, progress, request, shard, cache_dir), path


def check_shardable(args: ModelArgs, shard) -> None:
    """Tensor parallel (a shard) splits the dense width and Mixtral's experts; a ValueError for what it cannot."""
    if shard is not None and args.kv_lora_rank is not None:
        raise ValueError("tensor parallel does not split DeepSeek's latent attention (MLA); run it on one device")
    if shard is not None and args.moe_bias:
        raise ValueError("tensor parallel does not split gpt-oss's experts (their biases); run it on one device")
    if shard is not None and args.moe_hidden_dim is not None:
        raise ValueError("tensor parallel does not split Qwen3-MoE's experts (moe_intermediate_size); run it on one "
                         "device")


def release_freed_memory() -> None:
    """Hand freed heap memory back to the OS: glibc keeps the per-tensor temporaries (float32 copies, quantization
    intermediates) fragmented, so without this the peak RSS of a load grows with every tensor. A no-op off glibc."""
    libc = ctypes.CDLL(None)
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


# ---- Hugging Face folders ----

# what a float weight may be stored as: it is cast to the dtype (MXFP4: gpt-oss's experts, decoded as read)
SAFETENSORS_FLOATS = ("F64", "F32", "F16", "BF16", "MXFP4")
SAFETENSORS_INTS = {torch.int8: "I8", torch.uint8: "U8", torch.int64: "I64"}  # codes: int8, int4 in bytes; in_perm


def check_dtypes(model: Transformer, found: dict[str, str], source: str) -> None:
    """A ValueError naming a tensor whose safetensors dtype (found: name -> "F32", "I8", ...) the model cannot take:
    a float weight stored as integers or bool, or quantized codes not in the integer type they were saved in."""
    for name, t in checkpoint_state(model).items():
        want = SAFETENSORS_FLOATS if t.is_floating_point() else (SAFETENSORS_INTS[t.dtype],)
        if found[name] not in want:
            raise ValueError(f"{source}: tensor {name} is stored as {found[name]}, expected {' or '.join(want)}")


def checkpoint_quantization(path: str, files: list[str], request: Quantization) -> tuple[str, bool, bool] | None:
    """The (mode, quantize_head, act_order) a quantized folder was saved with, from its safetensors metadata, or None;
    a request that differs from it is an error (the checkpoint's codes cannot be re-quantized)."""
    try:
        meta = hffolder.read_quantization(os.path.join(path, files[0]))
    except Exception as e:  # safetensors raises its own error types for corrupt or truncated files
        raise ValueError(f"cannot read safetensors file {os.path.join(path, files[0])!r}: {e}") from None
    if meta is None:
        return None
    saved = mode_name(*parse_mode(meta["quantization"] + (f":{meta['group_size']}" if meta["group_size"] else "")))
    saved_head, act_order = meta["quantize_head"] == "true", meta.get("act_order") == "true"
    if not request.as_stored and (request.mode, request.head) != (saved, saved_head):
        raise ValueError(f"{path!r} is quantized as {saved}{' with the head' if saved_head else ''}; "
                         f"requested {request.mode or 'none'}{' with the head' if request.head else ''}: drop "
                         "--quantize to load it as saved, or quantize from the original weights")
    return saved, saved_head, act_order


def load_hf_folder(path: str, device, dtype: torch.dtype, progress: bool, request: Quantization, shard) -> Transformer:
    """A Hugging Face folder: config.json plus model.safetensors or a sharded index;
    a folder export.py wrote is rebuilt with its quantized modules."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"no config.json in model folder {path!r}")
    config = hffolder.read_json(config_file)
    full_args = ModelArgs.from_hf_config(config)
    check_shardable(full_args, shard)
    files = hffolder.safetensors_files(path)
    packed = hfquant.packed_format(config, config_file)
    if packed is not None:
        return load_packed_folder(path, packed, full_args, files, device, dtype, progress, request, shard)
    saved = checkpoint_quantization(path, files, request)
    if saved is not None and shard is not None:
        raise ValueError(f"{path!r} is a quantized checkpoint, which tensor parallel cannot slice; load the "
                         "original weights with --quantize instead")

    with torch.device("meta"):
        model = shard.model(full_args) if shard else build_model(full_args)
    if saved is not None:  # the saved modules first: the file holds their buffers
        swap_linears(model, *saved)
    handles, found = hffolder.open_safetensors(path, files, full_args.attn_sinks)
    shapes = {k: shard.local_shape(k, v[2], full_args) if shard else v[2] for k, v in found.items()}
    check_tensors(checkpoint_shapes(model), shapes, path)
    check_dtypes(model, {k: v[4] for k, v in found.items()}, path)
    filler = Filler(model, device, dtype, path)
    if saved is None and request.mode is not None:  # quantized as each float weight is read
        swap_linears(model, request.mode, request.head)
    # gpt-oss's MXFP4 experts: kept as their codes unless a --quantize asks for floats (none) or other codes
    as_mxfp4 = request.as_stored and any(v[3] is not None and v[3][0] == "mxfp4" for v in found.values())
    if as_mxfp4:
        mxfp4.swap_experts(model)

    for name, (file, key, _, pick, _) in tqdm(found.items(), desc="loading", disable=not progress, unit="tensor"):
        try:
            if as_mxfp4 and pick is not None and pick[0] == "mxfp4":
                filler.put_mxfp4(name, *mxfp4.expert_codes(handles[file], key, pick))
                continue
            t = hffolder.read_tensor(handles[file], key, pick, name, shard, full_args)
        except Exception as e:
            raise ValueError(f"cannot read tensor {key!r} from {file!r}: {e}") from None
        filler.put(name, t)
        release_freed_memory()
    return filler.finish()


def load_packed_folder(path: str, fmt: hfquant.PackedFormat, args: ModelArgs, files: list[str], device,
                       dtype: torch.dtype, progress: bool, request: Quantization, shard) -> Transformer:
    """A GPTQ / AWQ folder (hfquant.py): each linear's packed codes into an Int4Linear as they are."""
    if shard is not None or not request.as_stored:
        raise ValueError(f"{path!r} is a {fmt.method.upper()} checkpoint, which loads as its own codes: drop "
                         "--quantize (and tensor parallel)")
    with torch.device("meta"):
        model = build_model(args)
    handles, found = hffolder.open_safetensors(path, files)
    check_tensors(checkpoint_shapes(model), hfquant.float_shapes({k: v[2] for k, v in found.items()}, fmt), path)
    filler = Filler(model, device, dtype, path)
    head = "lm_head.qweight" in found
    group = fmt.int4_group([m.in_features for n, m in model.named_modules()
                            if isinstance(m, nn.Linear) and (head or n != "lm_head")])
    swap_linears(model, f"int4:{group}", head, fmt.act_order)
    for name, (file, key, _, pick, _) in tqdm(found.items(), desc="loading", disable=not progress, unit="tensor"):
        prefix, _, kind = name.rpartition(".")
        if kind == "qweight":
            tensors = {k: handles[found[f"{prefix}.{k}"][0]].get_tensor(found[f"{prefix}.{k}"][1])
                       for k in hfquant.PACKED if f"{prefix}.{k}" in found}
            filler.put_int4_blocks(prefix + ".weight", *hfquant.int4_blocks(tensors, fmt, prefix, group))
        elif kind not in hfquant.PACKED:
            filler.put(name, hffolder.read_tensor(handles[file], key, pick, name, None, args))
    return filler.finish()


# ---- GGUF files ----

@dataclass(frozen=True)
class GGUFRoutes:
    """How the tensors of one GGUF file load, decided once from the file and the request; put() sends each tensor
    down its one route: the head's Q8_0 codes, a block linear's Q4 codes, or dequantized (then cast or quantized)."""
    args: ModelArgs  # the full model's: q/k heads to unpermute, and what a shard slices
    codes: frozenset[str]  # the block linears (our modules) that take the file's Q4 codes as they are (int4:32)
    q8_0_head: str | None  # the tensor whose Q8_0 codes the head runs as (Int8GroupLinear), or None
    permuted_qk: bool  # q/k rows in llama.cpp's interleaved RoPE order (gguffile.PERMUTED_QK)
    shard: object = None
    mxfp4: bool = False  # gpt-oss's experts, all MXFP4 in the file, kept as their codes (formats/mxfp4.py)

    @classmethod
    def decide(cls, tensors: dict, slots: dict[str, tuple[str, int]], args: ModelArgs, arch: str, request: Quantization,
               shard) -> "GGUFRoutes":
        """A block linear (slots: checkpoint module -> ours, so q/k/v are qkv_proj's parts) takes the file's codes
        when each of its parts is Q4_0/Q4_1/Q4_K (4-bit blocks of 32) and nothing asks for other modules: another
        mode, a quantized head (quantized from the dequantized embedding). A shard slices the codes as they are
        (tp.Shard.take_codes; load_gguf refuses a cut inside a group before any reading).
        The others dequantize: a Q4_K_M file's Q6_K attn_v makes its layer's qkv_proj float."""
        kinds: dict[str, set[str]] = {}  # our block linear -> its parts' block types
        for name, t in tensors.items():
            if name.startswith("layers.") and name.endswith("_proj.weight"):
                kinds.setdefault(slots[name.removesuffix(".weight")][0], set()).add(t.tensor_type.name)
        as_codes = not request.head and (request.as_stored or request.mode == "int4:32")
        codes = frozenset(m for m, types in kinds.items() if types <= set(gguffile.INT4_TYPES)) if as_codes else \
            frozenset()
        # Without --quantize, a Q8_0 head runs as the file's codes, in a float32 model too: the kernel rounds the
        # head's input to bf16, which costs SmolLM2 less than a bf16 model does (KL 5.1e-4 against 2.2e-4 with a
        # float32 head, top-1 unchanged; README, Quantization), and the head is then exact whatever the row count,
        # as a float32 matmul is not (greedy speculative == plain greedy, README, Exactness). It is the largest
        # matrix of a small model, read every step in 1.25 bytes a weight instead of bf16's 2.
        head = "lm_head.weight" if "lm_head.weight" in tensors else "embed_tokens.weight"  # tied: the embedding
        q8_0 = request.as_stored and tensors[head].tensor_type.name == "Q8_0"  # a shard's: its vocabulary rows
        experts = [t.tensor_type.name for n, t in tensors.items() if ".experts." in n and n.endswith("proj.weight")]
        mxfp4 = request.as_stored and bool(experts) and set(experts) == {"MXFP4"}
        return cls(args, codes, head if q8_0 else None, arch in gguffile.PERMUTED_QK, shard, mxfp4)

    def swap_modules(self, model: Transformer, request: Quantization) -> None:
        """Swap in the modules this load builds (after the Filler took the file's float names)."""
        if request.mode is not None:  # int4:32 too: the code modules take the codes, the rest is quantized
            swap_linears(model, request.mode, request.head)
        for name in self.codes:
            linear = model.get_submodule(name)
            if not isinstance(linear, Int4Linear):
                model.set_submodule(name, make_quantized_linear("int4", 32, linear, model.norm.weight.dtype))
        if self.q8_0_head:  # a tied embedding keeps its dequantized copy for the lookup
            model.lm_head = Int8GroupLinear(model.args.dim, model.lm_head.out_features, device="meta")
        if self.mxfp4:
            mxfp4.swap_experts(model)

    def takes_codes(self, name: str, slots: dict[str, tuple[str, int]]) -> bool:
        """Whether checkpoint tensor `name` loads as the file's int4 codes (slots: Filler.slots)."""
        return name.endswith("_proj.weight") and slots[name.removesuffix(".weight")][0] in self.codes

    def put(self, filler: Filler, name: str, t, shape: tuple[int, ...]) -> None:
        region = self.shard.region(name, self.args) if self.shard else None
        if region is not None and region[0] == 0:  # a shard's rows: only they are read (GGUF blocks pack whole rows)
            t, shape, region = gguffile.row_range(t, *region[1:]), (region[2] - region[1], *shape[1:]), None
        if name == self.q8_0_head:
            filler.put_head_codes(name, *gguffile.q8_0_blocks(t, shape))
            if name == "lm_head.weight":
                return  # untied; a tied head's matrix is also the embedding, dequantized below
        if self.mxfp4 and t.tensor_type.name == "MXFP4":
            filler.put_mxfp4(name, *gguffile.mxfp4_blocks(t, shape))
            return
        heads = shape[0] // self.args.head_dim  # whole heads (a shard's too), each permuted on its own
        qk = self.permuted_qk and name.endswith(("q_proj.weight", "k_proj.weight"))
        if self.takes_codes(name, filler.slots):
            blocks = gguffile.int4_blocks(t, shape)
            blocks = self.shard.take_codes(name, *blocks, self.args) if region else blocks  # columns, group-wise
            filler.put_int4_blocks(name, *(gguffile.unpermute_qk(x, heads) if qk else x for x in blocks))
            return
        try:
            w = gguffile.dequantize(t, shape)
        except (NotImplementedError, ValueError) as e:  # gguf.quants: a block type it cannot dequantize
            raise ValueError(f"cannot dequantize GGUF tensor {name!r} ({t.tensor_type.name}): {e}") from None
        if qk:
            w = gguffile.unpermute_qk(w, heads)
        filler.put(name, self.shard.take(name, w, self.args) if region else w)


def with_rope_freqs(args: ModelArgs, rope_freqs, path: str) -> ModelArgs:
    """args with a Llama 3.1 file's per-frequency rope divisors (its rope_freqs.weight, if it has one)."""
    if rope_freqs is None:
        return args
    if rope_freqs.tensor_type.name != "F32" or rope_freqs.shape != (args.head_dim // 2,):
        raise ValueError(f"{path!r}: rope_freqs.weight is {rope_freqs.tensor_type.name} {rope_freqs.shape}, "
                         f"expected F32 ({args.head_dim // 2},)")
    return dataclasses.replace(args, rope_freq_factors=tuple(float(x) for x in rope_freqs.data))


def load_gguf(path: str, device: torch.device, dtype: torch.dtype, progress: bool, request: Quantization, shard,
              cache_dir: str | None = None) -> Transformer:
    """A GGUF file (config.GGUF_ARCHITECTURES): dequantized to dtype with the gguf package (or, with a mode,
    from float32 straight to int8/int4 codes), or its Q4 linears and Q8_0 head as their codes (GGUFRoutes). With
    cache_dir (CPU, no shard), from a weights cache entry when there is one, which a miss writes (weightcache.py)."""
    try:
        meta, file_tensors = gguffile.read_gguf(path, string_arrays=False)  # the vocabulary is the tokenizer's
    except (ValueError, OSError) as e:
        raise ValueError(f"cannot read GGUF file {path!r}: {e}") from None
    longrope = {f"{kind}_factor": [float(x) for x in t.data] for t in file_tensors for kind in ("long", "short")
                if t.name == f"rope_factors_{kind}.weight"}  # Phi-3's, a few numbers each
    full_args = ModelArgs.from_gguf(meta, {t.name for t in file_tensors}, longrope or None)
    arch = meta["general.architecture"]
    tensors, full_shapes = gguffile.named_tensors(file_tensors, arch)
    if arch == "deepseek2":
        gguffile.join_kv_b(tensors, full_shapes)
    full_args = with_rope_freqs(full_args, tensors.pop("rope_freqs.weight", None), path)
    check_shardable(full_args, shard)
    for name in ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"):
        tensors.pop(name, None)
        full_shapes.pop(name, None)
    with torch.device("meta"):
        model = shard.model(full_args) if shard else build_model(full_args)
    shapes = {k: shard.local_shape(k, v, full_args) for k, v in full_shapes.items()} if shard else full_shapes
    check_tensors(checkpoint_shapes(model), shapes, path)
    filler = Filler(model, device, dtype, path)
    routes = GGUFRoutes.decide(tensors, filler.slots, full_args, arch, request, shard)
    for name in tensors if shard is not None else ():  # before any reading: a cut inside a quantization group
        if routes.takes_codes(name, filler.slots):
            shard.check_group_cut(name, full_shapes[name], full_args)
    routes.swap_modules(model, request)
    entry = None if cache_dir is None or shard is not None or device.type != "cpu" else \
        weightcache.Entry.of(cache_dir, path, device, dtype, request)
    if entry is not None and entry.restore(model):
        return filler.finish(restored=True)
    for name, t in tqdm(tensors.items(), desc="loading", disable=not progress, unit="tensor"):
        routes.put(filler, name, t, full_shapes[name])
        release_freed_memory()
    model = filler.finish()
    if entry is not None:
        entry.store(model)
    return model
