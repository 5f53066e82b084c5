"""A Llama-family decoder-only transformer (Llama 2/3, Mistral, Mixtral, SmolLM2, Qwen2/2.5, Qwen3, Qwen3-MoE, Phi-3,
Gemma 2/3) in plain PyTorch: the math only, the reference a device's own paths are tested against. DeepSeek's blocks
(latent attention, its router) are models/deepseek.py's, on these parts; RoPE's frequency scalings models/rope.py's.

Shape legend used in the comments:
  B batch, T tokens in this call, S key positions (cache length), C model width,
  H query heads, K key/value heads (GQA: H is a multiple of K), D head dim, V vocab,
  M = B x T token rows, E experts (Mixtral), k experts per token, F one MLP's (or expert's) width.
The hyper-parameters (ModelArgs) and their mappings to and from checkpoint configs live in config.py; loading and
converting checkpoints in load.py; the KV cache in kvcache.py; the CPU's attention and one-row products in ops/cpu.py
(Attention.attend and Linear.product, installed by step.device_paths).
"""
import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from config import ModelArgs
from formats.parts import Parts
from kvcache import KVCache, LayerKVCache
from models.rope import rope_attention_factor, rope_inv_freq  # the checkpoints' RoPE frequencies and scalings


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first R dims of (B, H, T, D) by position, with cos and sin (T, R/2), or (B, 1, T, R/2) with per-row
    positions, in x's dtype; R = D but for partial rotary (Phi-4-mini), whose last D - R dims pass as they are.
    Half-rotation layout: dim i pairs with i + R/2 (Hugging Face's layout; gguffile.unpermute_qk converts a llama
    GGUF's interleaved q/k rows to it)."""
    r = 2 * cos.shape[-1]
    x1, x2 = x[..., :r].chunk(2, dim=-1)  # (B, H, T, R/2) each
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)  # (B, H, T, R)
    return rotated if r == x.shape[-1] else torch.cat([rotated, x[..., r:]], dim=-1)  # (B, H, T, D)


def written_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                      softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(cap(q k^T * scale)) v written out in float32, for Gemma 2: SDPA takes a mask but no function of the
    scores, and its soft-capping cap(s) = c tanh(s / c) goes between the product and the softmax; for gpt-oss, whose
    per-head sink logits (H,) join each softmax as one more column, dropped after it. q (B, H, T, D), k and v
    (B, K, S, D), mask (T, S) or (B, 1, T, S)."""
    B, H, T, D = q.shape
    K, S = k.shape[1], k.shape[2]
    qg = q.float().reshape(B, K, H // K * T, D)  # (B, K, G*T, D): a kv head's G query heads, as rows
    scores = (qg @ k.float().transpose(-2, -1) * scale).view(B, K, H // K, T, S)  # (B, K, G, T, S)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask.unsqueeze(-3), float("-inf"))  # mask (.., 1, T, S) over the G heads
    if sinks is not None:  # a column of each head's sink logit: (B, K, G, T, S + 1), its share of the softmax dropped
        scores = torch.cat([scores, sinks.float().view(1, K, H // K, 1, 1).expand(B, -1, -1, T, 1)], dim=-1)
    p = torch.softmax(scores, dim=-1)[..., :S].reshape(B, K, H // K * T, S)  # (B, K, G*T, S)
    return (p @ v.float()).view(B, H, T, D).to(q.dtype)  # (B, H, T, D)


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Boolean mask, True where the query at q_pos may attend the key at k_pos:
    (T, S) from q_pos (T,), k_pos (S,); (B, T, S) when either has a batch dimension."""
    q, k = q_pos[..., :, None], k_pos[..., None, :]  # (..., T, 1), (..., 1, S)
    mask = k <= q
    if sliding_window is not None:
        mask = mask & (k > q - sliding_window)
    return mask


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, steps: bool) -> torch.Tensor:
    """Attention.attend's default: q (B, H, T, D), k and v (B, K, S, D), mask (T, S) or (B, 1, T, S); enable_gqa
    shares each kv head among H/K query heads without copying. `steps` (decode steps, not a prefill): ops/cpu.py's."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # (B, H, T, D)


class Linear(Parts, nn.Linear):
    """An nn.Linear, bias-free unless asked (Qwen2's q/k/v), computed by `product(x, weight, bias)`: F.linear, or a
    device's own (step.device_paths)."""
    product: Callable = staticmethod(F.linear)

    def __init__(self, in_features: int, out_features: int, parts: dict[str, int] | None = None, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.parts = parts
        assert parts is None or sum(parts.values()) == out_features, f"{parts} vs {out_features} rows"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, plus_one: bool = False):
        super().__init__()
        self.eps, self.plus_one = eps, plus_one
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 even for bf16/fp16 activations, as the reference implementation does.
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.plus_one:  # Gemma stores w - 1 and scales in float32 before rounding (transformers' Gemma2RMSNorm)
            return (y * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * y.to(x.dtype)


class Sinks(nn.Module):
    """gpt-oss's learned attention sinks: one logit per head (H,) that joins every softmax (written_attention)."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_heads))


class Attention(nn.Module):
    attend: Callable = staticmethod(sdpa)  # or a device's own (step.device_paths)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        # q, k and v as one weight (rows q | k | v): one larger matmul instead of three. Checkpoints keep
        # q_proj/k_proj/v_proj, the parts the loader hands in (formats/parts.py); Phi-3's store qkv_proj itself.
        q_rows, kv_rows = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        parts = None if args.fused_checkpoint else {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows}
        self.qkv_proj = Linear(args.dim, q_rows + 2 * kv_rows, parts, bias=args.qkv_bias)
        self.o_proj = Linear(args.n_heads * args.head_dim, args.dim, bias=args.o_bias)
        self.sinks = Sinks(args.n_heads) if args.attn_sinks else None  # gpt-oss
        # Qwen3, Gemma 3: each head's q and k RMS-normed (over D) before RoPE
        norm = (args.head_dim, args.norm_eps, args.norm_plus_one)
        self.q_norm = RMSNorm(*norm) if args.qk_norm else None
        self.k_norm = RMSNorm(*norm) if args.qk_norm else None
        self.scale, self.softcap = args.attn_scale, args.attn_softcap  # Gemma; None: SDPA's 1/sqrt(D), no cap

    def forward(self, x, input_pos, cos, sin, mask, cache: LayerKVCache | None, steps: bool = False):
        B, T, _ = x.shape
        H, K, D = self.n_heads, self.n_kv_heads, self.head_dim
        qk, v = self.qkv_proj(x).split([(H + K) * D, K * D], dim=-1)  # (B, T, (H+K)*D), (B, T, K*D)
        qk = qk.view(B, T, H + K, D)  # (B, T, H+K, D)
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :, :H]), self.k_norm(qk[:, :, H:])], dim=2)  # (B, T, H+K, D)
        qk = qk.transpose(1, 2)  # (B, H+K, T, D)
        q, k = apply_rope(qk, cos, sin).split([H, K], dim=1)  # q and k in one go: (B, H, T, D), (B, K, T, D)
        v = v.view(B, T, K, D).transpose(1, 2)  # (B, K, T, D)
        if cache is not None:  # the keys before RoPE too, for a cache that rotates them as read (sinks.SinkLayer)
            k, v = cache.update(input_pos, k, v, k_unrotated=qk[:, H:])  # (B, K, S, D): the mask hides unwritten slots
        if self.scale is not None or self.softcap is not None or self.sinks is not None:
            sinks = None if self.sinks is None else self.sinks.weight
            y = written_attention(q, k, v, mask, self.scale or D ** -0.5, self.softcap, sinks)
        else:
            y = self.attend(q, k, v, mask, steps)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, H*D)
        return self.o_proj(y)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, width: int | None = None):
        super().__init__()
        width = width or args.hidden_dim
        parts = None if args.fused_checkpoint else {"gate_proj": width, "up_proj": width}
        self.gate_up_proj = Linear(args.dim, 2 * width, parts, bias=args.moe_bias)  # rows gate | up
        self.down_proj = Linear(width, args.dim, bias=args.moe_bias)
        self.gelu, self.limit = args.mlp_act == "gelu_pytorch_tanh", args.swiglu_limit  # Gemma 2's GeGLU; gpt-oss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (..., F) each
        if self.limit is not None:  # gpt-oss: both clamped, gate x sigmoid(1.702 gate) (up + 1)
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
            return self.down_proj(gate * torch.sigmoid(1.702 * gate) * (up + 1))
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * up)  # SwiGLU (GeGLU)


class Router(nn.Module):
    """Mixtral's gate: which k of the E experts each token goes to, and with what weights. Not a Linear, so
    quantization leaves it in model precision (a few E x C weights; a flipped choice would change the output)."""

    def __init__(self, dim: int, n_experts: int, top_k: int, renormalize: bool = True, bias: bool = False):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.weight = nn.Parameter(torch.randn(n_experts, dim) / math.sqrt(dim))  # varied routing for random runs
        self.bias = nn.Parameter(torch.zeros(n_experts)) if bias else None  # gpt-oss

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (M, C) -> float32 weights (M, k) and expert ids (M, k), as transformers computes them: softmax over all
        E logits in float32, the top k, renormalized to sum to 1 (Qwen3-MoE: unless norm_topk_prob is false; gpt-oss's
        softmax over the top k logits is the same)."""
        probs = torch.softmax(F.linear(x, self.weight, self.bias).float(), dim=-1)  # (M, E)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # (M, k) each
        return weights / weights.sum(dim=-1, keepdim=True) if self.renormalize else weights, ids


class MoE(nn.Module):
    """Mixtral's sparse mixture of experts: each token runs through k of the E SwiGLU experts, weighted by the
    router. The experts are plain MLPs (one module each), so quantization and tensor parallelism treat them as
    they treat the dense MLP. Expert selection depends on the data: no torch.compile (step.Step)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate = Router(args.dim, args.n_experts, args.n_experts_per_token, args.moe_renormalize, args.moe_bias)
        self.experts = nn.ModuleList(MLP(args, args.moe_hidden_dim) for _ in range(args.n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # (M, C)
        weights, ids = self.gate(rows)  # (M, k) each
        if rows.shape[0] == 1:
            # A batch-1 decode step: only the k selected experts run, so it reads k of the E experts' weights
            # (Mixtral-8x7B: 2 of 8, about 13 B of its 47 B parameters with attention and embeddings).
            y = sum(w * self.experts[e](rows).float() for w, e in zip(weights[0], ids[0].tolist()))  # (1, C)
            return y.to(x.dtype).view(x.shape)
        # Prefill and batches: tokens grouped by expert; each expert that received any token reads its weights
        # once, for all of its tokens (at most all E; a batch of one-token rows reads about E(1 - (1 - k/E)^M)).
        out = torch.zeros(rows.shape, dtype=torch.float32, device=x.device)  # (M, C)
        for e in ids.unique().tolist():
            token, slot = torch.where(ids == e)  # (n,) each: the rows routed to e, and which of their k picks
            y = self.experts[e](rows[token]).float() * weights[token, slot, None]  # (n, C)
            out.index_add_(0, token, y)
        return out.to(x.dtype).view(x.shape)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, i: int):
        super().__init__()
        norm = (args.dim, args.norm_eps, args.norm_plus_one)  # each RMSNorm's arguments
        self.input_layernorm = RMSNorm(*norm)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(*norm)  # before the MLP; Gemma 2: after attention (sandwich norms)
        if args.sandwich_norms:
            self.pre_feedforward_layernorm, self.post_feedforward_layernorm = RMSNorm(*norm), RMSNorm(*norm)
        self.mlp = MLP(args) if args.n_experts is None or i in args.dense_layers else MoE(args)
        self.sandwich = args.sandwich_norms
        # Gemma: only some layers see a sliding window; they take the second of Transformer.inputs' two masks (and,
        # Gemma 3, of its two RoPE tables).
        self.windowed = args.sliding_layers is not None and i in args.sliding_layers
        # Tensor parallel (tp.py): this rank's o_proj / down_proj outputs are partial sums; this adds them up.
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.all_reduce is None else self.all_reduce(x)

    def forward(self, x, input_pos, cos, sin, mask, cache: LayerKVCache | None, steps: bool = False):
        mask = mask[self.windowed] if isinstance(mask, tuple) else mask
        cos, sin = (cos[self.windowed], sin[self.windowed]) if isinstance(cos, tuple) else (cos, sin)
        a = self.reduce(self.self_attn(self.input_layernorm(x), input_pos, cos, sin, mask, cache, steps))
        if self.sandwich:  # Gemma: each sublayer's input and output normed
            h = x + self.post_attention_layernorm(a)
            return h + self.post_feedforward_layernorm(self.reduce(self.mlp(self.pre_feedforward_layernorm(h))))
        h = x + a
        return h + self.reduce(self.mlp(self.post_attention_layernorm(h)))


class Transformer(nn.Module):
    """Parameter names follow Hugging Face's (without the `model.` prefix), except the fused qkv_proj and
    gate_up_proj, which take a checkpoint's q/k/v and gate/up tensors as their parts (formats/parts.py)."""
    block_type: type[Block] = Block  # a family's own blocks: models/deepseek.py's DeepseekTransformer

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        # nn.Embedding's own init on the meta device (where loaders build the model) would import torch._dynamo: 1.6 s
        weight = torch.empty(args.vocab_size, args.dim)  # (V, C)
        weight = weight if weight.is_meta else weight.normal_()  # nn.Embedding's own init, N(0, 1)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim, _weight=weight)
        self.layers = nn.ModuleList(self.block_type(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps, args.norm_plus_one)
        self.lm_head = Linear(args.dim, args.vocab_size)
        if args.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.reset_rope()

    def reset_rope(self, device: torch.device | str | None = None) -> None:
        """(Re)build the cos/sin tables, e.g. after the model was built on the meta device; Gemma 3's sliding layers
        get their own (rope_local_cos / rope_local_sin: their base, unscaled)."""
        device = device or self.embed_tokens.weight.device
        tables = {"rope": self.args}
        if self.args.rope_local_theta is not None:
            tables["rope_local"] = dataclasses.replace(self.args, rope_theta=self.args.rope_local_theta,
                                                       rope_scaling=None, rope_freq_factors=None)
        for prefix, args in tables.items():
            with torch.device("cpu"):  # on the meta device (a loader's), arange would import torch._dynamo: 2 s
                positions = torch.arange(args.max_seq_len, dtype=torch.float32)
                freqs = torch.outer(positions, rope_inv_freq(args))  # (max_seq_len, R/2)
                scale = rope_attention_factor(args)
                cos, sin = freqs.cos() * scale, freqs.sin() * scale
            self.register_buffer(f"{prefix}_cos", cos.to(device), persistent=False)
            self.register_buffer(f"{prefix}_sin", sin.to(device), persistent=False)

    def layer_rope(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's float32 (cos, sin) tables, (max_seq_len, R/2) each: Gemma 3's sliding layers have their own."""
        if self.args.rope_local_theta is not None and i in self.args.sliding_layers:
            return self.rope_local_cos, self.rope_local_sin
        return self.rope_cos, self.rope_sin

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, cache: KVCache | None = None,
                all_logits: bool = False, steps: bool = False) -> torch.Tensor:
        """tokens (B, T) at positions input_pos: (T,) shared by all rows, or (B, T) per row (batches of
        different lengths). With a cache, keys/values are written to it at input_pos and attention covers
        every cached position; without one, only these T tokens. steps: the T tokens are decode steps (one, or a
        speculative verify's), not a prefill, which a device's attention may compute otherwise (step.device_paths).
        Returns float32 logits (B, T, V), or (B, 1, V) for the last position unless all_logits."""
        x, cos, sin, mask = self.inputs(tokens, input_pos, cache)
        for i, layer in enumerate(self.layers):
            x = layer(x, input_pos, cos, sin, mask, None if cache is None else cache.layers[i], steps)
        return self.head(x, all_logits)

    def inputs(self, tokens: torch.Tensor, input_pos: torch.Tensor, cache: KVCache | None):
        """What every layer takes: the embeddings (B, T, C), RoPE's cos and sin at input_pos and the attention
        mask over the cache's slots (or the T tokens without one). step.py runs its compiled layers between
        inputs() and head()."""
        x = self.embed_tokens(tokens)  # (B, T, C)
        if self.args.embed_scale:  # Gemma: by sqrt(C) rounded to the activations' dtype, as transformers does
            x = x * torch.tensor(self.args.dim ** 0.5).to(x.dtype)
        # The positions RoPE and the mask see: the queries' and each cache slot's (kvcache.KVCache.positions; a
        # rolling cache, sinks.SinkKVCache, numbers its slots within its window).
        q_pos, k_pos = (input_pos, input_pos) if cache is None else cache.positions(input_pos)
        # computed in float32, rounded to the activations' dtype once for every layer (as transformers does)
        cos, sin = self.rope_cos[q_pos].to(x.dtype), self.rope_sin[q_pos].to(x.dtype)  # (T, D/2) or (B, T, D/2)
        if self.args.rope_local_theta is not None:  # Gemma 3: (full, windowed) tables, each Block takes its own
            cos, sin = (cos, self.rope_local_cos[q_pos].to(x.dtype)), (sin, self.rope_local_sin[q_pos].to(x.dtype))
        if self.args.sliding_layers is None:
            mask = attention_mask(q_pos, k_pos, self.args.sliding_window)  # (T, S) or (B, T, S)
        else:  # Gemma: (full, windowed), each Block takes its own
            mask = tuple(attention_mask(q_pos, k_pos, w) for w in (None, self.args.sliding_window))
        if input_pos.dim() == 2:  # broadcast over heads: (B, 1, T, .)
            cos, sin, mask = (tuple(t[:, None] for t in v) if isinstance(v, tuple) else v[:, None]
                              for v in (cos, sin, mask))
        return x, cos, sin, mask

    def head(self, x: torch.Tensor, all_logits: bool) -> torch.Tensor:
        """The last layer's output (B, T, C) -> float32 logits (B, T, V), or (B, 1, V) unless all_logits."""
        if not all_logits:
            x = x[:, -1:]  # (B, 1, C): generation only needs the next-token distribution
        logits = self.lm_head(self.norm(x)).float()  # (B, T or 1, V)
        cap = self.args.final_softcap  # Gemma: logits soft-capped to (-cap, cap)
        return logits if cap is None else torch.tanh(logits / cap) * cap
