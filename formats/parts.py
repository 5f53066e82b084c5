"""Linears that checkpoints store as several tensors (q_proj | k_proj | v_proj as one qkv_proj): the rows each part
fills, how a loader hands a part in and how a writer reads the parts back (formats/checkpoint.py)."""
import torch
import torch.nn as nn


class Parts:
    """A linear that checkpoints store as several tensors: `parts` {checkpoint name: rows} in row order (qkv_proj:
    q_proj | k_proj | v_proj), or None for one stored as itself. A loader hands in each part as it reads it
    (load_part); parts_state gives them back. quantize.py's Int8Linear / Int4Linear mix it in too (ROW_DIMS)."""
    parts: dict[str, int] | None = None
    ROW_DIMS: dict[str, int] = {}  # a tensor whose output rows are not its dim 0

    def row_counts(self) -> tuple[int, ...]:
        """The row counts a weight handed to this module may have: its own, or one part's."""
        return (self.out_features, *(self.parts or {}).values())

    def part_rows(self, i: int) -> tuple[int, int]:
        """(first row, rows) of part i."""
        sizes = list(self.parts.values()) if self.parts else [self.out_features]
        return sum(sizes[:i]), sizes[i]

    def load_part(self, i: int, tensors: dict[str, torch.Tensor]) -> None:
        """Part i's tensors (name -> tensor, as a checkpoint stores them) into this module: a linear stored as
        itself takes them as they are; a fused one copies their rows into its own, made (zeros) by the first part
        to arrive, so rows past the parts' (padding) stay zero. Rows past a part's own are padding: dropped."""
        start, n = self.part_rows(i)
        for name, t in tensors.items():
            current = getattr(self, name)
            if self.parts is None:
                assert t.shape == current.shape, f"{name}: {tuple(t.shape)} vs {tuple(current.shape)}"
                new = t
            else:
                dim = self.ROW_DIMS.get(name, 0)
                new = torch.zeros(current.shape, dtype=t.dtype, device=t.device) if current.is_meta else current
                new.narrow(dim, start, n).copy_(t.narrow(dim, 0, n))
            if new is not current:
                setattr(self, name, nn.Parameter(new, requires_grad=False) if name in self._parameters else new)

    def parts_state(self) -> list[dict[str, torch.Tensor]]:
        """Each part's tensors as a checkpoint stores them (views of this module's rows); unfused, [state_dict()]."""
        state = self.state_dict()
        if self.parts is None:
            return [state]
        return [{name: t.narrow(self.ROW_DIMS.get(name, 0), *self.part_rows(i)) for name, t in state.items()}
                for i in range(len(self.parts))]
