"""Reading a GGUF file: its metadata as plain Python values and its tensors as memory-mapped numpy arrays; and the
format's conversions to this runtime's: tensor names, llama.cpp's q/k row order, the Q4_0/Q4_1/Q4_K/Q8_0 blocks as
codes and scales, and dequantization in bounded steps (load.py decides which a tensor gets).

gguf's GGUFReader reads the same, but builds numpy views for every part of every metadata value: on SmolLM2 (a
49,152-token vocabulary and 48,900 merges) it takes about 2 s, and a run reads the file twice (the weights, then the
tokenizer). This reads the metadata with `struct` in about 0.1 s. The tensors are what GGUFReader gives (the same
numpy dtypes and shapes), so dequantizing them stays the gguf package's (gguf.quants).

Layout (little-endian, versions 2 and 3): "GGUF", version u32, tensor count u64, metadata count u64; each metadata
entry a string key, a u32 value type and the value; then each tensor's name, n_dims u32, dims u64 (fastest first),
ggml type u32 and data offset u64; the tensor data starts at the next multiple of `general.alignment` (32).
"""
import mmap
import struct
from dataclasses import dataclass

import gguf
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, quant_shape_to_byte_shape

SCALARS = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
           GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
           GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
           GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d"}
# GGUF tensor names (llama.cpp) -> ours, which are Hugging Face's without the `model.` prefix.
GGUF_TOP_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # Mixtral's router
}
# an architecture's own block names: Phi-3's fused linears, stored as we run them (ffn_up holds gate | up)
# and Gemma's four norms (its ffn_norm is the MLP's pre-norm, our post_attention_layernorm its attention post-norm)
GEMMA_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"}
# DeepSeek's latent attention, shared experts and V3's router bias (its whole name: exp_probs_b.bias); attn_k_b and
# attn_v_b are kv_b_proj split per head by the converter, joined back by join_kv_b
DEEPSEEK2_NAMES = {"attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
                   "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
                   "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_k_b": "self_attn.k_b_proj",
                   "attn_v_b": "self_attn.v_b_proj", "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
                   "ffn_up_shexp": "mlp.shared_experts.up_proj", "ffn_down_shexp": "mlp.shared_experts.down_proj"}
GGUF_ARCH_NAMES = {"phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
                   "gemma2": GEMMA_NAMES, "gemma3": GEMMA_NAMES, "deepseek2": DEEPSEEK2_NAMES,
                   "gpt-oss": {"attn_sinks": "self_attn.sinks", "post_attention_norm": "post_attention_layernorm"}}
GGUF_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}  # (E, N, K)
# tensor types GGUFReader returns as numbers; every other type (BF16, the quantized blocks) as rows of bytes
NUMERIC = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
           GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
           GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64}


@dataclass
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order (slowest dimension first)
    data: np.ndarray  # shape for numeric types; else uint8 with the last dimension in bytes (gguf's byte shape)


@dataclass(frozen=True)
class SkippedStrings:
    """An array of strings read_gguf walked past without decoding (string_arrays=False): how many it holds."""
    count: int

    def __len__(self) -> int:
        return self.count


class Cursor:
    """Reads little-endian values from a buffer, front to back. string_arrays=False: an array of strings is walked
    past (SkippedStrings), about 4x faster than decoding a 49,152-token vocabulary."""

    def __init__(self, buf, string_arrays: bool = True):
        self.buf, self.pos, self.string_arrays = buf, 0, string_arrays

    def scalar(self, fmt: str):
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        self.pos += n
        return bytes(self.buf[self.pos - n:self.pos]).decode("utf-8", errors="replace")

    def value(self, kind: int):
        kind = GGUFValueType(kind)
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind != GGUFValueType.ARRAY:
            return self.scalar(SCALARS[kind])
        item, n = GGUFValueType(self.scalar("<I")), self.scalar("<Q")
        if item in SCALARS:  # numbers: one numpy read for the whole array
            dtype = np.dtype(SCALARS[item])
            end = self.pos + n * dtype.itemsize
            if end > len(self.buf):
                raise ValueError("an array runs past the end of the file")
            values = np.frombuffer(self.buf[self.pos:end], dtype=dtype).tolist()
            self.pos = end
            return values
        if item == GGUFValueType.STRING:
            return self.strings(n)
        return [self.value(item) for _ in range(n)]

    def strings(self, n: int) -> list[str] | SkippedStrings:
        """n strings, one loop without method calls (a vocabulary has ~50-250k): decoded, or walked past."""
        buf, pos, length, out = self.buf, self.pos, struct.Struct("<Q").unpack_from, []
        for _ in range(n):
            end = pos + 8 + length(buf, pos)[0]
            if self.string_arrays:
                out.append(str(buf[pos + 8:end], "utf-8", "replace"))
            pos = end
        if pos > len(buf):
            raise ValueError("a string runs past the end of the file")
        self.pos = pos
        return out if self.string_arrays else SkippedStrings(n)


def read_gguf(path: str, string_arrays: bool = True) -> tuple[dict, list[GGUFTensor]]:
    """(metadata {key: value}, tensors in file order). Arrays are lists, as GGUFReader's contents() gives them;
    string_arrays=False: arrays of strings (the vocabulary, the merges: a tokenizer's, not a model's) are
    SkippedStrings. A file that is not a little-endian GGUF of version 2 or 3, or that ends early, is a ValueError."""
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # stays mapped while the tensors' arrays use it
    cur = Cursor(memoryview(buf), string_arrays)
    try:
        magic, version = bytes(cur.buf[:4]), struct.unpack_from("<I", cur.buf, 4)[0]
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"not a little-endian GGUF file of version 2 or 3 (magic {magic!r}, version {version})")
        cur.pos = 8
        n_tensors, n_meta = cur.scalar("<Q"), cur.scalar("<Q")
        meta = {}
        for _ in range(n_meta):
            key = cur.string()
            meta[key] = cur.value(cur.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name, n_dims = cur.string(), cur.scalar("<I")
            dims = [cur.scalar("<Q") for _ in range(n_dims)]
            infos.append((name, GGMLQuantizationType(cur.scalar("<I")), tuple(reversed(dims)), cur.scalar("<Q")))
    except struct.error:
        raise ValueError("the file ends inside its header") from None
    alignment = meta.get("general.alignment", 32)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1:
        raise ValueError(f"general.alignment must be a positive integer, got {alignment!r}")
    start = (cur.pos + alignment - 1) // alignment * alignment
    everything = np.frombuffer(buf, dtype=np.uint8)
    tensors = []
    for name, kind, shape, offset in infos:
        block, block_bytes = GGML_QUANT_SIZES[kind]
        n_bytes = int(np.prod(shape)) * block_bytes // block
        raw = everything[start + offset:start + offset + n_bytes]
        if len(raw) != n_bytes:
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        data = raw.view(NUMERIC[kind]).reshape(shape) if kind in NUMERIC else \
            raw.reshape(quant_shape_to_byte_shape(shape, kind))
        tensors.append(GGUFTensor(name, kind, shape, data))
    return meta, tensors


# ---- the format's tensors as ours ----

@dataclass
class ExpertSlice:
    """One expert's (N, K) matrix of a GGUF tensor that stacks all E experts, read as int4_blocks and
    dequantize read a file tensor (GGUFTensor): its data rows and block type."""
    data: object  # numpy rows (N, K) or (N, bytes per row) of one expert
    tensor_type: object


def row_range(t, start: int, stop: int) -> ExpertSlice:
    """Rows start:stop of a file tensor (a tensor-parallel rank's), read as a whole tensor is: GGUF blocks pack
    whole rows, so only those rows' bytes are read."""
    return ExpertSlice(t.data[start:stop], t.tensor_type)


def named_tensors(file_tensors: list[GGUFTensor], arch: str = "llama") -> tuple[dict, dict[str, tuple]]:
    """The file's tensors under our names ({name: GGUFTensor or ExpertSlice}) and their torch shapes: a stacked
    `blk.3.ffn_up_exps.weight` (E, F, C) is E tensors `layers.3.mlp.experts.E.up_proj.weight` (F, C) (gpt-oss: its
    `ffn_up_exps.bias` (E, F) E biases); a phi3 file's
    `blk.3.ffn_up.weight` is `layers.3.mlp.gate_up_proj.weight`."""
    tensors, shapes = {}, {}
    for t in file_tensors:
        shape = t.shape
        parts = t.name.split(".")
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in GGUF_EXPERT_NAMES and len(shape) == (
                2 if parts[3] == "bias" else 3):  # gpt-oss's expert biases are stacked too, (E, F)
            for e in range(shape[0]):
                name = f"layers.{parts[1]}.mlp.experts.{e}.{GGUF_EXPERT_NAMES[parts[2]]}.{parts[3]}"
                tensors[name], shapes[name] = ExpertSlice(t.data[e], t.tensor_type), shape[1:]
            continue
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in GGUF_ARCH_NAMES.get(arch, {}):
            name = f"layers.{parts[1]}.{GGUF_ARCH_NAMES[arch][parts[2]]}.{parts[3]}"
        elif parts[0] == "blk" and parts[2:] == ["exp_probs_b", "bias"]:
            name = f"layers.{parts[1]}.mlp.gate.e_score_correction_bias"
        else:
            name = tensor_name(t.name)
        tensors[name], shapes[name] = t, shape
    return tensors, shapes


def join_kv_b(tensors: dict, shapes: dict[str, tuple]) -> None:
    """deepseek2: llama.cpp's converter stores kv_b_proj per head as attn_k_b (H, R, N), transposed for its absorbed
    attention, and attn_v_b (H, Dv, R); joined back in place into kv_b_proj (H x (N + Dv), R), transformers' rows."""
    for name in [n for n in tensors if n.endswith("self_attn.k_b_proj.weight")]:
        v_name, joined = name.replace("k_b_proj", "v_b_proj"), name.replace("k_b_proj", "kv_b_proj")
        k, v = dequantize(tensors.pop(name), shapes.pop(name)), dequantize(tensors.pop(v_name), shapes.pop(v_name))
        w = torch.cat([k.transpose(1, 2), v], dim=1)  # (H, N + Dv, R)
        w = w.reshape(-1, w.shape[-1]).numpy()  # (H x (N + Dv), R)
        tensors[joined], shapes[joined] = GGUFTensor(joined, GGMLQuantizationType.F32, w.shape, w), w.shape


def tensor_name(gguf_name: str) -> str:
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


PERMUTED_QK = ("llama",)  # the architectures whose q/k rows llama.cpp's converter permutes (qwen2/qwen3 keep HF's)


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp stores a llama file's q/k rows with RoPE pairs interleaved (2i, 2i+1); our RoPE pairs (i, i + D/2).
    Its converter reshaped each head's rows as (2, D/2) -> (D/2, 2); this is the inverse."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # llama.cpp block types whose codes Int4Linear (group 32) takes as they are


def int4_blocks(t, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0/Q4_1/Q4_K tensor's codes (N, K) uint8 in [0, 15] and per-32 scale and zero (N, K/32) float32, in our
    int4 scheme w = (q - 8) * scale + zero. Q4_1 stores d and m with w = d * q + m: scale d, zero m + 8d; Q4_0 is
    w = d * (q - 8): zero 0. A block's 16 bytes hold weights j (low nibble) and j + 16 (high nibble)."""
    if t.tensor_type.name == "Q4_K":
        return q4_k_blocks(t, shape)
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


def k_scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 6-bit scales and mins of a Q4_K/Q5_K super-block's 8 sub-blocks from its 12 bytes: (..., 12) uint8 ->
    (..., 8) each. Sub-blocks 0-3 have theirs in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7
    their low 4 bits in bytes 8-11 (scale: low nibble, min: high) and their top 2 bits in the top 2 of bytes 0-7."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]  # (..., 4) each
    scales = torch.cat([a & 63, (c & 15) | ((a >> 2) & 48)], dim=-1)
    mins = torch.cat([b & 63, (c >> 4) | ((b >> 2) & 48)], dim=-1)
    return scales, mins


def q4_k_blocks(t, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4_blocks for Q4_K. A 144-byte super-block of 256 weights: d and dmin (float16), the 12 bytes of its 8
    sub-blocks' 6-bit scales sc and mins m, then 128 bytes of codes, bytes 32c..32c+31 holding sub-block 2c (low
    nibbles) and 2c + 1 (high). w = d·sc·q - dmin·m: scale d·sc and zero 8·d·sc - dmin·m. d·sc and dmin·m are exact
    in float32 (a float16 times a 6-bit integer), so the zero is rounded once, by the subtraction."""
    N, K = shape
    raw = torch.from_numpy(t.data.copy()).view(N, K // 256, 144)  # (N, super-blocks, bytes)
    d = raw[..., 0:2].contiguous().view(torch.float16).float()  # (N, K/256, 1)
    dmin = raw[..., 2:4].contiguous().view(torch.float16).float()
    sc, m = k_scales_and_mins(raw[..., 4:16])  # (N, K/256, 8)
    qs = raw[..., 16:].reshape(N, K // 256, 4, 1, 32)  # (N, K/256, pairs of sub-blocks, 1, 32)
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=3).view(N, K)  # (N, K/256, 4, 2, 32) -> (N, K)
    scales = d * sc.float()  # (N, K/256, 8)
    zeros = 8 * scales - dmin * m.float()
    return codes, scales.view(N, K // 32), zeros.view(N, K // 32)


def q8_0_blocks(t, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor's codes (N, K) int8 and per-block scale d (N, K/32) float32: w = d * q. A block is d (float16)
    and 32 int8 codes."""
    N, K = shape
    raw = torch.from_numpy(t.data.copy()).view(N, K // 32, 34)  # (N, blocks, bytes per block)
    d = raw[..., 0:2].contiguous().view(torch.float16).float()[..., 0]  # (N, K/32)
    return raw[..., 2:].contiguous().view(torch.int8).reshape(N, K), d


def mxfp4_blocks(t, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """An MXFP4 tensor as a safetensors checkpoint holds it (formats/mxfp4.py): blocks (N, K/32, 16) bytes, two
    codes a byte in order, and scales (N, K/32). A GGUF block is the scale byte (the same E8M0 exponent: ggml's
    doubled values times 2^(e - 128)) and 16 bytes whose low nibbles are the block's first 16 codes, high its last."""
    N, K = shape
    raw = torch.from_numpy(t.data.copy()).view(N, K // 32, 17)  # (N, blocks, bytes per block)
    qs = raw[..., 1:]  # (N, G, 16)
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # (N, G, 32) in order
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), raw[..., 0].contiguous()


def dequantize(t, shape: tuple[int, ...], rows: int = 4096) -> torch.Tensor:
    """A GGUF tensor as float32, dequantized `rows` rows at a time: numpy's temporaries for a large
    embedding would otherwise be several times its size, and set the peak memory of the whole load."""
    out = torch.empty(shape, dtype=torch.float32)
    flat = out.view(shape[0], -1)  # (rows, ...) -> 2-D; the file's data has one row per torch row
    for i in range(0, shape[0], rows):
        block = gguf.quants.dequantize(t.data[i:i + rows], t.tensor_type)  # may be a read-only memory-map view
        flat[i:i + rows] = torch.from_numpy(block.reshape(flat[i:i + rows].shape).copy())
    return out
