"""Static KV cache: preallocated, fixed-shape buffers the caller writes by position.

Shape legend: B batch, K key/value heads, S cache length (max_seq_len), T new tokens, D head dim.
Fixed shapes are what let the decode step be compiled once (and captured in a CUDA graph):
a step writes T slots with index_copy_ and attends over all S slots; the causal mask, built
from positions by the model, hides slots that are not written yet or are stale.
"""
import torch


class LayerKVCache:
    """One layer's keys and values, (B, K, S, D) each."""

    def __init__(self, batch_size: int, n_kv_heads: int, max_seq_len: int, head_dim: int, dtype, device):
        shape = (batch_size, n_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # The buffers never move, so a compiled step (CUDA graphs) can treat them as static.
        torch._dynamo.mark_static_address(self.k)
        torch._dynamo.mark_static_address(self.v)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (B, K, T, D) at positions input_pos, (T,) or per row (B, T);
        return the whole (B, K, S, D) buffers."""
        if input_pos.dim() == 1:
            self.k.index_copy_(2, input_pos, k.to(self.k.dtype))
            self.v.index_copy_(2, input_pos, v.to(self.v.dtype))
        else:
            rows = torch.arange(k.shape[0], device=k.device)[:, None]  # (B, 1), broadcast against (B, T)
            self.k[rows, :, input_pos] = k.transpose(1, 2).to(self.k.dtype)  # indexed view is (B, T, K, D)
            self.v[rows, :, input_pos] = v.transpose(1, 2).to(self.v.dtype)
        return self.k, self.v


class KVCache:
    """Per-layer caches for one batch of sequences. The caller owns positions; nothing here advances."""

    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.max_seq_len = max_seq_len
        self.layers = [LayerKVCache(batch_size, n_kv_heads, max_seq_len, head_dim, dtype, device)
                       for _ in range(n_layers)]

    @classmethod
    def for_model(cls, args, batch_size: int, max_seq_len: int, dtype: torch.dtype,
                  device: torch.device | str) -> "KVCache":
        """A cache shaped for ModelArgs `args` holding max_seq_len positions."""
        assert max_seq_len <= args.max_seq_len, f"{max_seq_len} vs context {args.max_seq_len}"
        return cls(args.n_layers, batch_size, args.n_kv_heads, max_seq_len, args.head_dim, dtype, device)

    def reset(self) -> None:
        for layer in self.layers:
            layer.k.zero_()
            layer.v.zero_()

    @property
    def nbytes(self) -> int:
        return sum(layer.k.nbytes + layer.v.nbytes for layer in self.layers)

    @property
    def bytes_per_token(self) -> int:
        """2 (k and v) x layers x kv heads x head dim x element size, per sequence."""
        k = self.layers[0].k
        return 2 * len(self.layers) * k.shape[1] * k.shape[3] * k.element_size()
