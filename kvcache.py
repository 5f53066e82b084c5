"""KV caches, the data a decode step reads besides the weights. The caller owns positions; a layer never advances
the cache.

- KVCache (static): per layer, preallocated fixed-shape buffers the caller writes by position, in the model dtype
  or int8 with a scale per token and head. Fixed shapes are what let the decode step be compiled once (and captured
  in a CUDA graph): a step writes T slots with index_copy_ and attends over all S slots; the mask, built from
  positions by the model, hides slots that are not written yet or are stale.
- BlockPool / PagedKVCache (paged, for engine.py): a pool of fixed-size blocks handed to sequences on demand, and
  the view of one batch's block tables that the model's layers update and attend through.

- Multi-head latent attention (DeepSeek, models/deepseek.py) caches one latent per token and layer, [c_kv | k_pe]
  (kv_lora_rank + qk_rope_head_dim): stored here as one key head of that width with an empty value (cache_dims),
  so every cache above holds it unchanged and its bytes per token are that width x layers x the dtype's bytes.

Shape legend: B batch, K key/value heads, S cache length (max_seq_len), T new tokens, D head dim (Dv the values').
"""
import torch

KV_DTYPES = ("model", "int8")


def cache_dims(args) -> tuple[int, int, int]:
    """(K, D, Dv) a ModelArgs' cache holds per position and layer: its kv heads of head_dim keys and values, or for
    latent attention one head whose key is the latent (kv_lora_rank + rope dims) and whose value is empty."""
    if args.kv_lora_rank is not None:
        return 1, args.kv_lora_rank + args.rope_dim, 0
    return args.n_kv_heads, args.head_dim, args.head_dim


def mark_static(*buffers: torch.Tensor) -> None:
    """Cache buffers never move, so a compiled step (CUDA graphs) can treat them as static and update them in place
    instead of copying them each replay. Only CUDA graphs need it, and it imports torch._dynamo (2 s) where an eager
    CPU run would not."""
    for t in buffers:
        if t.is_cuda:
            torch._dynamo.mark_static_address(t)


class LayerKVCache:
    """One layer's keys (B, K, S, D) and values (B, K, S, Dv), Dv = D unless value_dim says (0: latent attention)."""

    def __init__(self, batch_size: int, n_kv_heads: int, max_seq_len: int, head_dim: int, dtype, device,
                 value_dim: int | None = None):
        shape = (batch_size, n_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape[:3] + (head_dim if value_dim is None else value_dim,), dtype=dtype, device=device)
        mark_static(self.k, self.v)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               k_unrotated: torch.Tensor | None = None):
        """Write k, v (B, K, T, D) at positions input_pos, (T,) or per row (B, T); return the whole (B, K, S, D)
        buffers. k_unrotated, the keys before RoPE, is for a cache that rotates keys as it reads them
        (sinks.SinkLayer); every cache here stores k."""
        if input_pos.dim() == 1:
            self.k.index_copy_(2, input_pos, k.to(self.k.dtype))
            self.v.index_copy_(2, input_pos, v.to(self.v.dtype))
        else:
            rows = torch.arange(k.shape[0], device=k.device)[:, None]  # (B, 1), broadcast against (B, T)
            self.k[rows, :, input_pos] = k.transpose(1, 2).to(self.k.dtype)  # indexed view is (B, T, K, D)
            self.v[rows, :, input_pos] = v.transpose(1, 2).to(self.v.dtype)  # (B, T, K, Dv)
        return self.k, self.v

    def buffers(self) -> tuple[torch.Tensor, ...]:
        return self.k, self.v


class Int8LayerKVCache:
    """One layer's keys and values as int8 (B, K, S, D) with float32 scales (B, K, S, 1): per token, per head. An
    empty value (value_dim 0: latent attention's) has no scales either."""

    def __init__(self, batch_size: int, n_kv_heads: int, max_seq_len: int, head_dim: int, dtype, device,
                 value_dim: int | None = None):
        self.dtype = dtype  # what update() returns
        shape = (batch_size, n_kv_heads, max_seq_len, head_dim)
        value_dim = head_dim if value_dim is None else value_dim
        self.k = torch.zeros(shape, dtype=torch.int8, device=device)
        self.v = torch.zeros(shape[:3] + (value_dim,), dtype=torch.int8, device=device)
        self.k_scale = torch.zeros(shape[:3] + (1,), dtype=torch.float32, device=device)
        self.v_scale = torch.zeros(shape[:3] + (min(value_dim, 1),), dtype=torch.float32, device=device)
        mark_static(self.k, self.v, self.k_scale, self.v_scale)

    @staticmethod
    def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, K, T, D) -> int8 codes (B, K, T, D) and scales (B, K, T, 1): x ~= codes * scales."""
        if x.shape[-1] == 0:  # latent attention's empty value: nothing to scale
            return x.to(torch.int8), x.float()
        scale = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127  # (B, K, T, 1)
        return torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8), scale

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               k_unrotated: torch.Tensor | None = None):
        """Quantize and write k, v (B, K, T, D) at input_pos, (T,) or per row (B, T); return the whole cache
        dequantized, (B, K, S, D) in the model dtype. k_unrotated: as LayerKVCache.update's, unused."""
        (kq, ks), (vq, vs) = self.quantize(k), self.quantize(v)
        if input_pos.dim() == 1:
            for buf, new in ((self.k, kq), (self.k_scale, ks), (self.v, vq), (self.v_scale, vs)):
                buf.index_copy_(2, input_pos, new)
        else:
            rows = torch.arange(k.shape[0], device=k.device)[:, None]  # (B, 1), broadcast against (B, T)
            for buf, new in ((self.k, kq), (self.k_scale, ks), (self.v, vq), (self.v_scale, vs)):
                buf[rows, :, input_pos] = new.transpose(1, 2)  # indexed view is (B, T, K, D or 1)
        return (self.k.to(self.dtype) * self.k_scale.to(self.dtype),
                self.v.to(self.dtype) * self.v_scale.to(self.dtype))

    def buffers(self) -> tuple[torch.Tensor, ...]:
        return self.k, self.v, self.k_scale, self.v_scale


class KVCache:
    """Per-layer caches for one batch of sequences. The caller owns positions; nothing here advances."""

    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, kv_dtype: str = "model", value_dim: int | None = None):
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"unknown KV cache dtype {kv_dtype!r}; allowed: {', '.join(KV_DTYPES)}")
        self.max_seq_len = max_seq_len
        self.batch_size = batch_size
        layer_cls = Int8LayerKVCache if kv_dtype == "int8" else LayerKVCache
        self.layers = [layer_cls(batch_size, n_kv_heads, max_seq_len, head_dim, dtype, device, value_dim)
                       for _ in range(n_layers)]

    @classmethod
    def for_model(cls, args, batch_size: int, max_seq_len: int, dtype: torch.dtype,
                  device: torch.device | str, kv_dtype: str = "model") -> "KVCache":
        """A cache shaped for ModelArgs `args` holding max_seq_len positions; kv_dtype "model" or "int8"."""
        assert max_seq_len <= args.max_seq_len, f"{max_seq_len} vs context {args.max_seq_len}"
        K, D, Dv = cache_dims(args)
        return cls(args.n_layers, batch_size, K, max_seq_len, D, dtype, device, kv_dtype, None if Dv == D else Dv)

    def positions(self, input_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The positions RoPE and the mask give the queries at input_pos and the S slots: slot j holds position j."""
        return input_pos, torch.arange(self.max_seq_len, device=input_pos.device)

    @property
    def nbytes(self) -> int:
        """All buffers, int8 scales included."""
        return sum(t.nbytes for layer in self.layers for t in layer.buffers())

    @property
    def bytes_per_token(self) -> int:
        """Bytes one position of one sequence takes across layers: 2 (k and v) x layers x kv heads x
        (head dim x element size, + 4 for the float32 scale when int8); latent attention: layers x (latent width x
        element size, + 4 when int8)."""
        return self.nbytes // (self.batch_size * self.max_seq_len)


# ---- the paged cache: a pool of fixed-size blocks, handed to sequences on demand (engine.py) ----

class BlockPool:
    """The KV memory of a serving engine: per layer, keys and values for `num_blocks` blocks of `block_size`
    positions, (N_blocks, K, block_size, D) each. A sequence owns a list of blocks (its block table); position p
    lives in slot p % block_size of block table[p // block_size]. Nothing is reserved per sequence up front, so
    memory follows the tokens actually held, and blocks with equal contents can be shared (prefix caching).
    Block 0 is never handed out: it pads block tables, and the mask hides whatever it holds."""

    def __init__(self, n_layers: int, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, value_dim: int | None = None):
        shape = (num_blocks, n_kv_heads, block_size, head_dim)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        v_shape = shape[:3] + (head_dim if value_dim is None else value_dim,)  # latent attention: (N_blocks, 1, bs, 0)
        self.v = [torch.zeros(v_shape, dtype=dtype, device=device) for _ in range(n_layers)]
        mark_static(*self.k, *self.v)

    @classmethod
    def for_model(cls, args, num_blocks: int, block_size: int, dtype: torch.dtype,
                  device: torch.device | str) -> "BlockPool":
        K, D, Dv = cache_dims(args)
        return cls(args.n_layers, num_blocks, block_size, K, D, dtype, device, None if Dv == D else Dv)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.k, *self.v))

    def copy_block(self, src: int, dst: int) -> None:
        """Every layer's keys and values of block src into block dst (copy-on-write of a shared block)."""
        for t in (*self.k, *self.v):
            t[dst] = t[src]  # (K, block_size, D)

    @property
    def bytes_per_token(self) -> int:
        return self.nbytes // (self.num_blocks * self.block_size)


class PagedKVCache:
    """The KVCache interface over a BlockPool for one forward pass of B rows, each with its block table
    (B, N) (padded with block 0). Attention sees each row's blocks gathered in table order, so key index j is
    position j of that row and the model's position mask works unchanged; S = N x block_size."""

    def __init__(self, pool: BlockPool, block_tables: torch.Tensor):
        self.tables, self.block_size = block_tables, pool.block_size
        where = Slots(block_tables, pool.block_size)  # every layer writes the same positions: computed once
        self.layers = [PagedLayer(k, v, block_tables, pool.block_size, where) for k, v in zip(pool.k, pool.v)]

    @property
    def max_seq_len(self) -> int:
        """S, read off the tables' shape where a compiled step sees it: symbolic there, not an int it would guard."""
        return self.tables.shape[1] * self.block_size

    positions = KVCache.positions


class Slots:
    """Where positions are written in rows with these block tables: (block ids, slots in them), each (B, T). One
    forward's layers all write the same positions, so an eager forward computes them once, in its first layer
    (a compiled one computes them in each: a Python-side memo is not something a graph should guard on)."""

    def __init__(self, block_tables: torch.Tensor, block_size: int):
        self.tables, self.block_size = block_tables, block_size
        self.pos, self.at = None, None

    def __call__(self, input_pos: torch.Tensor, B: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pos is input_pos and not torch.compiler.is_compiling():
            return self.at
        pos = input_pos.expand(B, T)  # (B, T)
        at = self.tables.gather(1, pos // self.block_size), pos % self.block_size  # (B, T) block ids, slots
        if not torch.compiler.is_compiling():
            self.pos, self.at = input_pos, at
        return at


class PagedLayer:
    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                 where: Slots | None = None):
        self.k_pool, self.v_pool, self.tables, self.block_size = k_pool, v_pool, block_tables, block_size
        self.where = where or Slots(block_tables, block_size)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               k_unrotated: torch.Tensor | None = None):
        """Write k, v (B, K, T, D) at positions input_pos ((T,) or (B, T)) into the rows' blocks; return every
        row's blocks gathered, (B, K, S, D). k_unrotated: as LayerKVCache.update's, unused."""
        B, K, T, _ = k.shape
        blocks, slots = self.where(input_pos, B, T)  # (B, T) each
        self.k_pool[blocks, :, slots] = k.transpose(1, 2).to(self.k_pool.dtype)  # indexed view is (B, T, K, D)
        self.v_pool[blocks, :, slots] = v.transpose(1, 2).to(self.v_pool.dtype)
        N = self.tables.shape[1]

        def gather(pool: torch.Tensor) -> torch.Tensor:
            # (B N,) ids -> (B N, K, bs, D) -> (B, N, K, bs, D) -> (B, K, N, bs, D) -> (B, K, S, D); index_select
            # of whole blocks then one copy: half the time of pool[tables] (advanced indexing) or less at 1-32 rows
            rows = pool.index_select(0, self.tables.reshape(-1)).view(B, N, K, self.block_size, pool.shape[-1])
            return rows.transpose(1, 2).reshape(B, K, N * self.block_size, pool.shape[-1])

        return gather(self.k_pool), gather(self.v_pool)
