"""Int4 quantization that uses calibration activations: GPTQ and AWQ, into quantize.py's Int4Linear (the same grid as
round-to-nearest, w = (q - 8) * scale + zero per group of G inputs, bf16 scale and zero).

Shape legend: N out_features, K in_features (padded to a multiple of G), G group size, B GPTQ's block of columns,
M calibration rows (tokens), C model width, F one MLP's width.
- GPTQ (Frantar et al. 2022): each linear's columns are rounded one at a time and the error of each is spread over
  the columns not yet rounded, weighted by the inverse Hessian H = X^T X of the linear's inputs (damped), so the
  output error on the calibration inputs shrinks. Updates are applied B columns at a time (the same result as column
  by column, faster); act-order rounds the columns of largest H diagonal first (Int4Linear.in_perm keeps the order).
- AWQ (Lin et al. 2023): the inputs of a linear are scaled per channel by s = mean|x|^alpha (alpha searched on a
  grid) before round-to-nearest, so salient channels lose less; x / s is folded into what produces x (a norm's
  weight, the up projection's rows, v's rows), so the float model computes the same function before rounding.
- awq+gptq: AWQ's scales folded first, then GPTQ of the scaled weights with the scaled inputs' H.
- round, awq+round: learned rounding (AutoRound, Cheng et al. 2023), after AWQ's fold or without: each weight's
  rounding offset in [-0.5, 0.5] and each group's min and max shrink in [0.5, 1] are trained by signed gradient
  descent (the straight-through round) so that the quantized block's output, on the inputs the quantized blocks
  before it give, matches the float block's output on the float model's: the error the whole block makes, not each
  linear's alone.
- tune (tune_grid, after any of these): the groups' scales and zeros are trained end to end with the codes fixed, on
  the KL of the quantized model's next-token distributions from the float model's over the calibration sequences
  (the end-to-end step of EfficientQAT, Chen et al. 2024): rounding chose each code block by block, this fits the
  grid under them to the errors of all layers together. It keeps a float copy of the model for its targets.
All choose each group's scale and zero from its min and max shrunk by the factor of CLIP that minimizes the rounding
error weighted by H's diagonal (round-to-nearest's plain min/max lets one outlier coarsen the whole group's steps).
The blocks are calibrated in turn: the inputs of block i are the outputs of the already quantized blocks before it,
so the memory is one block's activations for the calibration tokens (and one H per linear; learned rounding keeps
the float model's too). The calibration tokens are a text's, and optionally text the float model writes itself from
it (sampled_sequences), which on SmolLM2 helps more than any other change tried (dev/LOG.md).
"""
import copy
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from kvcache import KVCache
from model import RMSNorm
from quantize import (KERNEL_DTYPE, Int4Linear, dequantize_int4, make_quantized_linear, parse_mode, quantization_of,
                      quantize_int4, unpermute_columns)
from step import device_paths

METHODS = ("rtn", "gptq", "awq", "awq+gptq", "round", "awq+round")
DAMP = 0.01  # GPTQ's damping: this fraction of H's mean diagonal added to it (the paper's default)
BLOCK = 128  # GPTQ's columns per lazy batch update
CLIP = tuple(1 - i / 40 for i in range(12))  # the range shrink factors a calibrated group's scale is chosen from
AWQ_GRID = 20  # alphas 0, 1/20, ..., 19/20 (AutoAWQ's grid)
ROUND_STEPS = 200  # learned rounding's signed-gradient steps a block, the learning rate 1 / ROUND_STEPS decaying
# linearly to 0 (AutoRound's)
ROUND_BATCH = 2  # calibration sequences a step
SEQ_LEN = 512  # calibration tokens per sequence
TUNE_LR = 1e-3  # Adam's learning rate for tune_grid's scales and zeros, decaying linearly to 0
TUNE_NORM_LR = 3e-4  # and for the norms' weights beside them
# Public-domain and project-written text, disjoint from quality.py's evaluation text: Genesis 1:1-19 (King James
# Version), the Gettysburg Address, and short stories and prose written for this project.
# the repository's data/, above features/
CALIBRATION_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                                "calibration.txt")


# ---- GPTQ ----

def int4_params(wg: torch.Tensor, h: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """wg (N, G) -> scale, zero (N,) rounded to bf16: from the group's min and max (quantize.quantize_int4's), or
    with input weights h (G,) from min and max shrunk by the CLIP factor that minimizes sum h (w - q(w))^2 per row
    (an outlier's rounding error then costs less than coarser steps for the rest)."""
    lo, hi = wg.amin(dim=1), wg.amax(dim=1)
    best = None
    for p in (1.0,) if h is None else CLIP:
        scale = ((p * (hi - lo)).clamp(min=1e-6) / 15).to(KERNEL_DTYPE).to(wg.dtype)
        zero = (p * lo + 8 * scale).to(KERNEL_DTYPE).to(wg.dtype)
        if h is None:
            return scale, zero
        _, wq = round_column(wg, scale[:, None], zero[:, None])
        err = ((wq - wg) ** 2 * h).sum(dim=1)  # (N,)
        if best is None:
            best = [err, scale, zero]
        else:
            better = err < best[0]
            for kept, new in zip(best, (err, scale, zero)):
                kept[better] = new[better]
    return best[1], best[2]


def round_column(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N,) -> codes in [0, 15] and the weights they stand for."""
    q = torch.round((w - zero) / scale + 8).clamp(0, 15)
    return q, (q - 8) * scale + zero


def gptq_order(H: torch.Tensor, act_order: bool) -> torch.Tensor | None:
    """Act-order: columns by decreasing H diagonal; dead columns (zero input: K's padding) last, in order."""
    if not act_order:
        return None
    d = H.diagonal()
    return torch.sort(torch.where(d > 0, d, -1.0), descending=True, stable=True).indices


def inverse_hessian_factor(H: torch.Tensor, damp: float) -> torch.Tensor:
    """The upper Cholesky factor U of (H + damp * mean diag)^-1 (= U^T U): row i holds the OBS update of the
    columns after i once columns < i are fixed, U[i, i] its scale."""
    H = H.clone()
    dead = H.diagonal() == 0
    H[dead, dead] = 1  # an input that is always zero: its weight is set to 0 and its row decouples
    H.diagonal().add_(damp * H.diagonal().mean())
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)


def gptq_solve(w: torch.Tensor, H: torch.Tensor, group: int, damp: float = DAMP, block: int = BLOCK,
               act_order: bool = False, clip: bool = True):
    """GPTQ of w (N, K) with inputs' H (K, K), K a multiple of G -> codes (N, K) uint8, scales and zeros (N, K/G)
    in code order, and the order (K,) (None without act_order): code column i is input perm[i]. A group's scale and
    zero come from its weights as updated when its first column is reached; blocks hold whole groups."""
    perm = gptq_order(H, act_order)
    W = (w if perm is None else w[:, perm]).clone()
    H = H if perm is None else H[perm][:, perm]
    W[:, H.diagonal() == 0] = 0
    U = inverse_hessian_factor(H, damp)
    h = H.diagonal()  # each input's weight in the output error, for the groups' clip search
    N, K = W.shape
    codes = torch.empty(N, K, dtype=torch.uint8, device=w.device)
    scales, zeros = (torch.empty(N, K // group, dtype=w.dtype, device=w.device) for _ in range(2))
    block = max(block // group, 1) * group
    for i1 in range(0, K, block):
        i2 = min(i1 + block, K)
        W1, U1 = W[:, i1:i2], U[i1:i2, i1:i2]  # (N, B), (B, B); W1 is updated in place
        errors = torch.empty_like(W1)  # (N, B): each column's scaled rounding error
        for i in range(i2 - i1):
            if (i1 + i) % group == 0:
                scale, zero = int4_params(W1[:, i:i + group], h[i1 + i:i1 + i + group] if clip else None)
                scales[:, (i1 + i) // group], zeros[:, (i1 + i) // group] = scale, zero
            q, wq = round_column(W1[:, i], scale, zero)
            codes[:, i1 + i] = q.to(torch.uint8)
            errors[:, i] = (W1[:, i] - wq) / U1[i, i]
            W1[:, i + 1:] -= errors[:, i:i + 1] * U1[i:i + 1, i + 1:]  # within the block, column by column
        W[:, i2:] -= errors @ U[i1:i2, i2:]  # the block's effect on every later column at once
    return codes, scales, zeros, perm


# ---- AWQ ----

def rtn_weight(w: torch.Tensor, group: int) -> torch.Tensor:
    """w (N, K) after round-to-nearest int4 (K zero-padded to a multiple of G, as Int4Linear pads it)."""
    K = w.shape[1]
    padded = F.pad(w.float(), (0, -K % group))
    return dequantize_int4(*quantize_int4(padded, group, KERNEL_DTYPE))[:, :K]


def awq_scale(w: torch.Tensor, H: torch.Tensor, x_mean: torch.Tensor, group: int) -> torch.Tensor:
    """AWQ's per-input scale s (K,) for weight w (N, K) whose inputs have H = X^T X and mean |x| x_mean (K,): the
    alpha on AWQ_GRID whose s = x_mean^alpha (normalized) minimizes the output error on the calibration inputs,
    trace((Q(w s) / s - w) H (Q(w s) / s - w)^T)."""
    best, best_s = None, torch.ones_like(x_mean)
    for alpha in (i / AWQ_GRID for i in range(AWQ_GRID)):
        s = x_mean.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        d = rtn_weight(w * s, group) / s - w  # (N, K)
        loss = ((d @ H) * d).sum().item()
        if best is None or loss < best:
            best, best_s = loss, s
    return best_s


def scale_norm(norm: nn.Module, s: torch.Tensor) -> None:
    """Divide an RMSNorm's output by s (C,): its weight (Gemma's stores w - 1)."""
    w = norm.weight.float()
    w = (1 + w) / s - 1 if norm.plus_one else w / s
    norm.weight.data = w.to(norm.weight.dtype)


def awq_fold(block: nn.Module, stats: dict, group: int) -> dict[nn.Module, torch.Tensor]:
    """Search and fold AWQ's scales into a block's float weights, the function unchanged: x / s into the norm (or the
    rows) that produce each linear's input, w * s into the linear's columns."""
    attn, mlp = block.self_attn, block.mlp
    ffn_norm = block.pre_feedforward_layernorm if block.sandwich else block.post_attention_layernorm
    targets = [(attn.qkv_proj, lambda s: scale_norm(block.input_layernorm, s)),
               (mlp.gate_up_proj, lambda s: scale_norm(ffn_norm, s)),
               (mlp.down_proj, lambda s: scale_rows(mlp.gate_up_proj, mlp.down_proj.in_features, s))]
    if attn.n_heads == attn.n_kv_heads:  # o_proj's inputs are v's outputs only without GQA (else a v row feeds H/K)
        targets.append((attn.o_proj, lambda s: scale_rows(attn.qkv_proj, (attn.n_heads + attn.n_kv_heads) *
                                                          attn.head_dim, s)))
    scales = [(linear, fold, awq_scale(linear.weight.float(), *stats[linear], group)) for linear, fold in targets]
    for linear, fold, s in scales:  # searched on the block as it was, then folded
        fold(s)
        linear.weight.data = (linear.weight.float() * s).to(linear.weight.dtype)
    return {linear: s for linear, _, s in scales}


def scale_rows(linear: nn.Module, first: int, s: torch.Tensor) -> None:
    """Divide a linear's output rows from `first` on (up in gate | up, v in q | k | v), and their bias, by s."""
    linear.weight.data[first:] = (linear.weight[first:].float() / s[:, None]).to(linear.weight.dtype)
    if linear.bias is not None:
        linear.bias.data[first:] = (linear.bias[first:].float() / s).to(linear.bias.dtype)


# ---- learned rounding ----

def round_ste(x: torch.Tensor) -> torch.Tensor:
    """round(x), with the gradient of x (the straight-through estimator)."""
    return x + (torch.round(x) - x).detach()


def learned_int4(w: torch.Tensor, offset: torch.Tensor, lo_shrink: torch.Tensor, hi_shrink: torch.Tensor,
                 group: int) -> tuple[torch.Tensor, ...]:
    """w (N, K), K a multiple of G, on round-to-nearest's grid with each weight's rounding offset (N, K/G, G) and each
    group's min and max scaled by lo_shrink, hi_shrink (N, K/G, 1) -> the weights (N, K) the codes stand for, the
    codes (N, K/G, G), scale and zero (N, K/G, 1); differentiable in the offsets and shrinks."""
    N, K = w.shape
    wg = w.view(N, K // group, group)
    lo, hi = wg.amin(-1, keepdim=True) * lo_shrink, wg.amax(-1, keepdim=True) * hi_shrink
    scale = (hi - lo).clamp(min=1e-6) / 15
    zero = lo + 8 * scale
    q = round_ste((wg - zero) / scale + 8 + offset).clamp(0, 15)
    return ((q - 8) * scale + zero).view(N, K), q, scale, zero


def learn_rounding(block: nn.Module, linears: dict[str, nn.Module], states: list, targets: list[torch.Tensor],
                   group: int, steps: int = ROUND_STEPS, batch: int = ROUND_BATCH, seed: int = 0) -> dict:
    """Train the rounding offsets and range shrinks of a float block's linears so that the block, its linears
    rounded, maps `states` (a block's inputs, as quantize_calibrated keeps them) to `targets` (B, T, C) with the
    least squared error: each step ROUND_BATCH of the full-length sequences, signed gradients, learning rate
    1 / steps decaying linearly to 0 (the parameters settle instead of walking to the end). -> {name: (codes (N, K),
    scales, zeros (N, K/G))}, K padded to a multiple of G, scale and zero rounded to bf16 and the codes rounded again
    on them."""
    weights = {name: F.pad(m.weight.detach().float(), (0, -m.in_features % group)) for name, m in linears.items()}
    params = {name: [torch.zeros(w.shape[0], w.shape[1] // group, group, requires_grad=True),
                     *(torch.ones(w.shape[0], w.shape[1] // group, 1, requires_grad=True) for _ in range(2))]
              for name, w in weights.items()}
    limits = ((-0.5, 0.5), (0.5, 1.0), (0.5, 1.0))
    longest = max(s[0].shape[1] for s in states)
    full = [i for i, s in enumerate(states) if s[0].shape[1] == longest]  # one shape: a batch is one forward
    generator = torch.Generator().manual_seed(seed)

    def loss(idx: list[int]) -> torch.Tensor:
        rounded = {name + ".weight": learned_int4(weights[name], *params[name], group)[0][:, :m.in_features]
                   .to(m.weight.dtype) for name, m in linears.items()}
        x = torch.cat([states[i][0] for i in idx])  # (B, T, C)
        out = torch.func.functional_call(block, rounded, (x, *states[idx[0]][1:], None))
        return F.mse_loss(out, torch.cat([targets[i] for i in idx]))

    with torch.enable_grad():
        for step in range(steps):
            idx = torch.randperm(len(full), generator=generator)[:batch].tolist()
            loss([full[i] for i in idx]).backward()
            lr = (1 - step / steps) / steps
            with torch.no_grad():
                for p, (low, high) in ((p, lim) for ps in params.values() for p, lim in zip(ps, limits)):
                    p.sub_(p.grad.sign() * lr).clamp_(low, high)
                    p.grad = None
    learned = {}
    for name, (offset, lo_shrink, hi_shrink) in params.items():
        _, _, scale, zero = learned_int4(weights[name], offset.detach(), lo_shrink.detach(), hi_shrink.detach(),
                                         group)
        scale, zero = (t.to(KERNEL_DTYPE).float() for t in (scale, zero))
        wg = weights[name].view(*offset.shape)
        codes = torch.round((wg - zero) / scale + 8 + offset.detach()).clamp(0, 15)
        learned[name] = (codes.flatten(1).to(torch.uint8), scale[..., 0], zero[..., 0])
    return learned


# ---- the grid tuned end to end ----

class TunableGrid(nn.Module):
    """An Int4Linear's product with its codes fixed and its groups' scales and zeros trainable: scale s (1 + a), zero
    z + s b, with a and b (N, K/G) starting at 0 (the Int4Linear's own weight). Float32; for tune_grid only."""

    def __init__(self, q: nn.Module):
        super().__init__()
        self.source = [q]  # in a list, not a submodule: its buffers stay out of the model's while the grid trains
        self.register_buffer("codes", q.codes().float().sub_(8))  # (N, K) padded, in code order
        s, z = q.scales_and_zeros.float().transpose(0, 1).unbind(-1)  # (N, K/G) each
        self.register_buffer("scale0", s.contiguous())
        self.register_buffer("zero0", z.contiguous())
        self.a = nn.Parameter(torch.zeros_like(s))
        self.b = nn.Parameter(torch.zeros_like(s))

    def grid(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The scales and zeros (N, K/G) the parameters give."""
        return self.scale0 * (1 + self.a), self.zero0 + self.scale0 * self.b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.source[0]
        scale, zero = self.grid()
        N, K = self.codes.shape
        w = (self.codes.view(N, -1, q.group_size) * scale[..., None] + zero[..., None]).view(N, K)
        w = w[:q.out_features, :q.in_features]  # (N, K) unpadded, as Int4Linear.dequantize
        w = w if q.in_perm is None else unpermute_columns(w, q.in_perm)
        return F.linear(x, w.to(x.dtype), None if q.bias is None else q.bias.to(x.dtype))

    @torch.no_grad()
    def tuned(self) -> nn.Module:
        """The Int4Linear, its scales and zeros replaced by the trained ones (rounded to bf16, as it stores them)."""
        q = self.source[0]
        scale, zero = self.grid()
        q.scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).to(KERNEL_DTYPE).contiguous()
        return q


class TunableNorm(nn.Module):
    """An RMSNorm whose weight trains as a float32 copy, cast to the norm's dtype for each forward. For tune_grid."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.source = [norm]  # in a list, not a submodule, as TunableGrid's
        self.weight = nn.Parameter(norm.weight.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = self.source[0]
        return torch.func.functional_call(norm, {"weight": self.weight.to(norm.weight.dtype)}, (x,))

    @torch.no_grad()
    def tuned(self) -> nn.Module:
        """The RMSNorm, its weight replaced by the trained one."""
        norm = self.source[0]
        norm.weight.copy_(self.weight)
        return norm


def tune_grid(model: nn.Module, reference: nn.Module, sequences: list[list[int]], passes: int, lr: float = TUNE_LR,
              norm_lr: float = TUNE_NORM_LR, seed: int = 0, progress: bool = False) -> nn.Module:
    """Tune every Int4Linear's group scales and zeros in place, end to end, their codes fixed, and the RMSNorms'
    weights (float in the quantized model too) beside them: Adam on the KL of the model's next-token distributions
    from the float reference's, one full-length calibration sequence a step, each pass over them in a seeded order,
    the learning rate decaying linearly to 0. Rounding picked each code block by block; this moves the grid under
    the codes, and the norms that scale each linear's inputs, so that all layers' errors together cost the output
    least."""
    device = model.embed_tokens.weight.device
    grids = {name: TunableGrid(m) for name, m in model.named_modules() if isinstance(m, Int4Linear)}
    norms = {name: TunableNorm(m) for name, m in model.named_modules() if isinstance(m, RMSNorm)}
    tunable = grids | norms
    for name, t in tunable.items():
        model.set_submodule(name, t)
    trained = {id(p) for t in tunable.values() for p in t.parameters()}
    frozen = [p for p in model.parameters() if p.requires_grad and id(p) not in trained]
    for p in frozen:
        p.requires_grad_(False)
    longest = max(map(len, sequences))
    full = [s for s in sequences if len(s) == longest]
    generator = torch.Generator().manual_seed(seed)
    order = [full[i] for _ in range(passes) for i in torch.randperm(len(full), generator=generator).tolist()]
    opt = torch.optim.Adam([{"params": [p for t in grids.values() for p in t.parameters()], "lr": lr},
                            {"params": [t.weight for t in norms.values()], "lr": norm_lr}])
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - step / len(order))
    try:
        with torch.enable_grad():
            for seq in tqdm(order, desc="tuning the grid", unit="seq", disable=not progress):
                tokens, pos = torch.tensor([seq], device=device), torch.arange(len(seq), device=device)
                with torch.no_grad():
                    want = torch.log_softmax(reference(tokens, pos, None, all_logits=True)[0], dim=-1)  # (T, V)
                got = torch.log_softmax(model(tokens, pos, None, all_logits=True)[0], dim=-1)  # (T, V)
                F.kl_div(got, want, reduction="batchmean", log_target=True).backward()  # KL(want || got) / T
                opt.step()
                opt.zero_grad()
                decay.step()
    finally:
        for p in frozen:
            p.requires_grad_(True)
        for name, t in tunable.items():
            model.set_submodule(name, t.tuned())
    return model


# ---- the model, block by block ----

def calibration_sequences(tokens: list[int], max_tokens: int | None, seq_len: int) -> list[list[int]]:
    """The first max_tokens of a text's tokens (all: None) in sequences of seq_len (the last one shorter)."""
    tokens = tokens[:max_tokens] if max_tokens else tokens
    return [tokens[i:i + seq_len] for i in range(0, len(tokens), seq_len) if len(tokens[i:i + seq_len]) > 1]


@torch.no_grad()
def sampled_sequences(model: nn.Module, tokens: list[int], n_tokens: int, seq_len: int, seed: int = 0,
                      batch: int = 16, progress: bool = False) -> list[list[int]]:
    """About n_tokens of calibration text the model writes itself, in sequences of seq_len: each starts from 4 tokens
    of `tokens` (the calibration text) at a seeded random place and goes on by sampling the model's own distribution
    (temperature 1), batch sequences at a time. Text the model finds likely spreads its activations as the text it
    will be asked to continue does, which a short calibration file does not."""
    device_paths(model)  # its device's attention and linear paths, as a Step's model has them
    device = model.embed_tokens.weight.device
    generator = torch.Generator().manual_seed(seed)
    n_seqs, n = -(-n_tokens // seq_len), min(4, len(tokens) - 1)
    starts = torch.randint(0, len(tokens) - n + 1, (n_seqs,), generator=generator).tolist()
    out = []
    for b in tqdm(range(0, n_seqs, batch), desc="sampling calibration", unit="batch", disable=not progress):
        rows = torch.tensor([tokens[i:i + n] for i in starts[b:b + batch]], device=device)  # (B, n)
        cache = KVCache.for_model(model.args, len(rows), seq_len, model.embed_tokens.weight.dtype, device)
        logits = model(rows, torch.arange(n, device=device), cache)  # (B, 1, V)
        for t in range(n, seq_len):
            probs = torch.softmax(logits[:, -1], dim=-1).cpu()  # (B, V)
            nxt = torch.multinomial(probs, 1, generator=generator).to(device)  # (B, 1)
            rows = torch.cat([rows, nxt], dim=1)
            if t + 1 < seq_len:
                logits = model(nxt, torch.tensor([t], device=device), cache, steps=True)
        out += rows.tolist()
    return out


def fill_int4(q: nn.Module, linear: nn.Module, codes, scales, zeros, perm) -> nn.Module:
    """Int4Linear q given codes (N, K) (in code order: column i is input perm[i]) with scales and zeros (N, K/G),
    part by part as loading fills it, the linear's bias beside them; packed for its kernel."""
    K = linear.in_features
    perm = None if perm is None else perm[:K]
    assert perm is None or torch.equal(perm.sort().values, torch.arange(K, device=perm.device)), "padding last"
    for i in range(len(q.parts or [None])):
        start, n = q.part_rows(i)
        rows = slice(start, start + n)
        q.load_part(i, q.buffers_for_codes(codes[rows, :K], scales[rows], zeros[rows], perm))
        if linear.bias is not None:
            q.load_part(i, {"bias": linear.bias[rows]})
    q.pack_for_kernel()
    return q


def gptq_linear(linear: nn.Module, H: torch.Tensor, group: int, act_order: bool, dtype: torch.dtype) -> nn.Module:
    """The Int4Linear GPTQ makes of a float linear whose inputs have H (K, K)."""
    q = make_quantized_linear("int4", group, linear, dtype, act_order)
    pad = q.in_padded - linear.in_features  # zero columns with zero inputs: dead, rounded last
    w = F.pad(linear.weight.float(), (0, pad))
    codes, scales, zeros, perm = gptq_solve(w, F.pad(H, (0, pad, 0, pad)), group, act_order=act_order)
    return fill_int4(q, linear, codes, scales, zeros, perm)


def clipped_linear(linear: nn.Module, h: torch.Tensor, group: int, dtype: torch.dtype) -> nn.Module:
    """The Int4Linear of a float linear rounded to nearest with each group's range clipped (int4_params with the
    inputs' weights h (K,))."""
    q = make_quantized_linear("int4", group, linear, dtype)
    pad = q.in_padded - linear.in_features
    w, h = F.pad(linear.weight.float(), (0, pad)), F.pad(h, (0, pad))
    params = [int4_params(w[:, g:g + group], h[g:g + group]) for g in range(0, w.shape[1], group)]
    scales, zeros = (torch.stack(p, dim=1) for p in zip(*params))  # (N, K/G) each
    s, z = (t.repeat_interleave(group, dim=1) for t in (scales, zeros))  # (N, K)
    codes, _ = round_column(w, s, z)
    return fill_int4(q, linear, codes.to(torch.uint8), scales, zeros, None)


def input_stats(block: nn.Module, linears: list[nn.Module], states: list) -> dict:
    """{linear: (H = X^T X (K, K), mean |x| (K,))} of each linear's inputs over the calibration states (float32)."""
    sums = {m: [torch.zeros(m.in_features, m.in_features), torch.zeros(m.in_features), 0] for m in linears}

    def hook(module, inputs, output):
        x = inputs[0].reshape(-1, module.in_features).float()  # (M, K)
        acc = sums[module]
        acc[0].addmm_(x.t(), x)
        acc[1] += x.abs().sum(0)
        acc[2] += x.shape[0]

    handles = [m.register_forward_hook(hook) for m in linears]
    try:
        for state in states:
            block(*state, None)
    finally:
        for h in handles:
            h.remove()
    return {m: (H, total / n) for m, (H, total, n) in sums.items()}


@torch.no_grad()
def quantize_calibrated(model: nn.Module, mode: str, method: str, sequences: list[list[int]],
                        act_order: bool = False, progress: bool = False, tune: int = 0) -> nn.Module:
    """Quantize a float model's block linears to int4 in place with `method` (METHODS: GPTQ, AWQ, learned rounding)
    from calibration token sequences, block by block (each block calibrated on the outputs of the quantized blocks
    before it); then, with tune > 0, that many passes of tune_grid against a float copy kept for it."""
    kind, group = parse_mode(mode)
    if kind != "int4" or method not in METHODS[1:]:
        raise ValueError(f"--method {method} with --mode {mode}: GPTQ, AWQ and learned rounding make int4:G "
                         "(rtn: any mode)")
    if act_order and "gptq" not in method:
        raise ValueError(f"--act-order is GPTQ's; drop it for --method {method}")
    if model.args.n_experts is not None:
        raise ValueError(f"--method {method}: Mixtral's experts are not supported (a router shares their input); "
                         "use --method rtn")
    if quantization_of(model) is not None:
        raise ValueError("the model is quantized already; quantize from its float weights")
    if tune < 0:
        raise ValueError(f"--tune {tune}: must be 0 or more")
    reference = copy.deepcopy(model) if tune else None
    dtype = model.norm.weight.dtype
    device = model.embed_tokens.weight.device
    states = []  # per sequence: (x, input_pos, cos, sin, mask), what a block takes
    for seq in sequences:
        pos = torch.arange(len(seq), device=device)
        x, cos, sin, mask = model.inputs(torch.tensor([seq], device=device), pos, None)  # x (1, T, C)
        states.append((x, pos, cos, sin, mask))
    float_states = states if "round" in method else None  # learned rounding's targets: the float model's
    for block in tqdm(model.layers, desc=method, unit="layer", disable=not progress):
        linears = {name: m for name, m in block.named_modules() if isinstance(m, nn.Linear)}
        stats = input_stats(block, list(linears.values()), states)
        scales = awq_fold(block, stats, group) if "awq" in method else {}
        if float_states is not None:  # the folded float block computes the float model's function
            float_states = [(block(*state, None), *state[1:]) for state in float_states]
            learned = learn_rounding(block, linears, states, [state[0] for state in float_states], group)
        for name, m in linears.items():
            H = stats[m][0]
            if m in scales:  # the inputs are x / s now
                H = H / scales[m][:, None] / scales[m][None, :]
            if "gptq" in method:
                q = gptq_linear(m, H, group, act_order, dtype)
            elif "round" in method:
                q = fill_int4(make_quantized_linear("int4", group, m, dtype), m, *learned[name], None)
            else:
                q = clipped_linear(m, H.diagonal(), group, dtype)
            block.set_submodule(name, q)
        del stats
        states = [(block(*state, None), *state[1:]) for state in states]
    if tune:
        del states, float_states
        tune_grid(model, reference, sequences, tune, progress=progress)
    return model
