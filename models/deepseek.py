"""DeepSeek-V2/V3's blocks on model.py's parts: multi-head latent attention (MLA) and DeepSeek's expert router.

MLA is a KV-cache trick, not a head-sharing one. Each token's keys and values come from one latent c_kv
(kv_lora_rank wide, RMS-normed) through the per-head up-projection kv_b_proj, plus one rotary key k_pe
(qk_rope_head_dim) that every head shares. The cache holds only [c_kv | k_pe] per token and layer: it is a one-"head"
KVCache whose key is that latent and whose value is empty (kvcache.cache_dims), so DeepSeek-V3 stores 576 numbers
a token and layer where its 128 heads of keys and values would be 40,960.

Two ways to attend over the latent, equal within rounding (tests/test_deepseek.py):
- plain: up-project every cached latent into H keys and values and attend as usual (what a prefill does);
- absorbed (decode steps): fold kv_b_proj's key half into the query (q_nope W_uk: a query in latent space) and its
  value half into the output, so the scores are taken against the cached latent itself and nothing S-long is
  up-projected: per step the work is H x S x (kv_lora_rank + qk_rope_head_dim) instead of S x kv_b_proj.

Shape legend (model.py's, and): R kv_lora_rank, P qk_rope_head_dim, N qk_nope_head_dim (D = N + P), Dv v_head_dim.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from config import ModelArgs
from kvcache import LayerKVCache
from model import MLP, Block, Linear, MoE, RMSNorm, Transformer, apply_rope
from models.rope import yarn_mscale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek rotates pairs (2i, 2i + 1); apply_rope pairs i with i + P/2. The same permutation of q_pe and k_pe
    leaves their dot products as they are, so the pairs are gathered into halves first: (..., P) -> (..., P)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class LatentAttention(nn.Module):
    """Multi-head latent attention; parameter names are transformers' (q_proj, or q_a_proj / q_a_layernorm / q_b_proj
    with q_lora_rank; kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj). absorb: None takes the absorbed path on
    decode steps and the plain one otherwise; True / False force one (the tests compare them)."""
    absorb: bool | None = None

    def __init__(self, args: ModelArgs):
        super().__init__()
        H, D, self.rank, self.rope_dim = args.n_heads, args.head_dim, args.kv_lora_rank, args.rope_dim
        self.n_heads, self.nope_dim, self.v_dim = H, D - args.rope_dim, args.v_head_dim
        if args.q_lora_rank is None:
            self.q_proj = Linear(args.dim, H * D)
        else:
            self.q_a_proj = Linear(args.dim, args.q_lora_rank)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, 1e-6)  # transformers' default eps for these two
            self.q_b_proj = Linear(args.q_lora_rank, H * D)
        self.kv_a_proj_with_mqa = Linear(args.dim, self.rank + self.rope_dim)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = Linear(self.rank, H * (self.nope_dim + self.v_dim))  # rows per head: W_uk (N) | W_uv (Dv)
        self.o_proj = Linear(H * self.v_dim, args.dim)
        self.interleaved = args.rope_interleaved
        # YaRN: the softmax scale takes mscale(mscale_all_dim) twice, beside the rotary dims' own attention factor
        scaling = args.rope_scaling or {}
        mscale = yarn_mscale(scaling["factor"], scaling.get("mscale_all_dim") or 0) if scaling.get(
            "rope_type") == "yarn" else 1.0
        self.scale = D ** -0.5 * mscale * mscale

    def forward(self, x, input_pos, cos, sin, mask, cache: LayerKVCache | None, steps: bool = False):
        B, T, _ = x.shape
        H, R, P, N = self.n_heads, self.rank, self.rope_dim, self.nope_dim
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(B, T, H, N + P).transpose(1, 2).split([N, P], dim=-1)  # (B, H, T, N), (B, H, T, P)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([R, P], dim=-1)  # (B, T, R), (B, T, P)
        if self.interleaved:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe, k_pe = apply_rope(q_pe, cos, sin), apply_rope(k_pe[:, None], cos, sin)  # k_pe: (B, 1, T, P)
        latent = torch.cat([self.kv_a_layernorm(c_kv)[:, None], k_pe], dim=-1)  # (B, 1, T, R + P)
        if cache is not None:  # the latent is the cache's one key head; its value is empty
            latent, _ = cache.update(input_pos, latent, latent[..., :0])  # (B, 1, S, R + P)
        absorb = steps if self.absorb is None else self.absorb
        y = (self.absorbed if absorb else self.plain)(q_nope, q_pe, latent, mask)  # (B, H, T, Dv)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * self.v_dim))

    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight as per-head matrices: W_uk (H, N, R) and W_uv (H, Dv, R) (a quantized one dequantized)."""
        w = self.kv_b_proj.dequantize() if hasattr(self.kv_b_proj, "dequantize") else self.kv_b_proj.weight
        return w.view(self.n_heads, self.nope_dim + self.v_dim, self.rank).split([self.nope_dim, self.v_dim], dim=1)

    def plain(self, q_nope, q_pe, latent, mask) -> torch.Tensor:
        """Keys and values up-projected from every cached latent: H heads of D-wide keys and Dv-wide values."""
        B, _, S, _ = latent.shape
        c_kv, k_pe = latent[:, 0].split([self.rank, self.rope_dim], dim=-1)  # (B, S, R), (B, S, P)
        kv = self.kv_b_proj(c_kv).view(B, S, self.n_heads, -1).transpose(1, 2)  # (B, H, S, N + Dv)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)  # (B, H, S, N), (B, H, S, Dv)
        k = torch.cat([k_nope, k_pe[:, None].expand(-1, self.n_heads, -1, -1)], dim=-1)  # (B, H, S, D)
        q = torch.cat([q_nope, q_pe], dim=-1)  # (B, H, T, D)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)  # (B, H, T, Dv)

    def absorbed(self, q_nope, q_pe, latent, mask) -> torch.Tensor:
        """The up-projections folded into the query and the output: q_nope . (W_uk c) = (W_uk^T q_nope) . c, so every
        head attends over the latent itself (one shared key head of R + P dims, its first R dims the value)."""
        w_uk, w_uv = self.up_weights()
        q = torch.cat([torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk), q_pe], dim=-1)  # (B, H, T, R + P)
        o = F.scaled_dot_product_attention(q, latent, latent[..., :self.rank], attn_mask=mask, scale=self.scale,
                                           enable_gqa=True)  # (B, H, T, R)
        return torch.einsum("bhtr,hvr->bhtv", o, w_uv)  # (B, H, T, Dv)


class DeepseekRouter(nn.Module):
    """DeepSeek's gate. V2: softmax scores, the top k (optionally within the best topk_group groups by their best
    score). V3: sigmoid scores, experts chosen by score + e_score_correction_bias (a load-balancing bias that does
    not weight), within the groups best by their top-2 sum; the chosen scores renormalized. Both scale the weights by
    routed_scaling. Kept in float32, not a Linear: quantization leaves it as it is (model.Router's reason)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        E = args.n_experts
        self.top_k, self.groups, self.top_groups = args.n_experts_per_token, args.n_group, args.topk_group
        self.sigmoid, self.renormalize, self.scaling = args.router_scoring == "sigmoid", args.moe_renormalize, \
            args.routed_scaling
        self.weight = nn.Parameter(torch.randn(E, args.dim) / math.sqrt(args.dim))
        if self.sigmoid:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(E))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (M, C) -> float32 weights (M, k) and expert ids (M, k), as transformers computes them."""
        logits = F.linear(x.float(), self.weight.float())  # (M, E)
        scores = logits.sigmoid() if self.sigmoid else logits.softmax(dim=-1)  # (M, E)
        choice = scores + self.e_score_correction_bias.float() if self.sigmoid else scores
        if self.top_groups < self.groups:
            grouped = choice.view(x.shape[0], self.groups, -1)  # (M, G, E/G)
            group_scores = grouped.topk(2, dim=-1)[0].sum(-1) if self.sigmoid else grouped.amax(-1)  # (M, G)
            best = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(
                1, group_scores.topk(self.top_groups, dim=-1)[1], True)  # (M, G)
            choice = grouped.masked_fill(~best[..., None], float("-inf") if self.sigmoid else 0.0).flatten(1)
        ids = choice.topk(self.top_k, dim=-1)[1]  # (M, k)
        weights = scores.gather(1, ids)  # (M, k)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class DeepseekMoE(MoE):
    """model.MoE's routed experts with DeepSeek's router, plus the shared experts every token runs through."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.gate = DeepseekRouter(args)
        self.shared_experts = MLP(args, args.moe_hidden_dim * args.n_shared_experts) if args.n_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y if self.shared_experts is None else y + self.shared_experts(x)


class DeepseekBlock(Block):
    """A pre-norm block (model.Block's forward) of latent attention and a dense MLP (the first_k_dense_replace
    layers) or DeepSeek's MoE."""

    def __init__(self, args: ModelArgs, i: int):
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = LatentAttention(args)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = MLP(args) if args.n_experts is None or i in args.dense_layers else DeepseekMoE(args)
        self.sandwich, self.windowed, self.all_reduce = False, False, None


class DeepseekTransformer(Transformer):
    """DeepSeek-V2/V3: model.Transformer with DeepseekBlocks."""
    block_type = DeepseekBlock
