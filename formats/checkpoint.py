"""A checkpoint's names and strict filling: which tensors a model's checkpoint holds (a fused linear's once per part,
a tied matrix once), the strict name/shape check, and Filler, which assigns each tensor to its module as it is read.

Loading is strict: every expected tensor present, nothing unexpected, every shape checked before any weight is
read (check_tensors), and at the end every expected tensor filled, once, and nothing left on the meta device
(Filler.finish). The model is built on the meta device and each tensor converted and assigned as it is read, so peak
memory stays near the final weight bytes. A fused linear (q/k/v, gate/up: formats/parts.py) takes each of its checkpoint
parts into its own rows as they arrive. Which file a tensor comes from, and how it is decoded, is load.py's.
"""
from collections.abc import Iterator

import torch
import torch.nn as nn

from formats.parts import Parts
from model import Transformer
from quantize import Int4Linear, Int8GroupLinear, Int8Linear, dequantize_state


# ---- a checkpoint's names: each module's tensors, a fused linear's once per part ----

def stored_modules(model: Transformer) -> Iterator[tuple[str, nn.Module]]:
    """The modules whose tensors a checkpoint holds (the leaves), a tied matrix once: the embedding, or the
    quantized head (then the embedding is its dequantized copy)."""
    tied = None
    if model.args.tie_embeddings:
        tied = "lm_head" if isinstance(model.lm_head, nn.Linear) else "embed_tokens"
    for name, module in model.named_modules():
        if name != tied and next(module.children(), None) is None:
            yield name, module


def part_names(name: str, module: nn.Module) -> list[str]:
    """The checkpoint names of a module's parts: a fused linear's siblings (layers.3.self_attn.qkv_proj ->
    layers.3.self_attn.q_proj, .k_proj, .v_proj), else its own."""
    parts = getattr(module, "parts", None)
    return [f"{name.rpartition('.')[0]}.{part}" for part in parts] if parts else [name]


def checkpoint_modules(model: Transformer) -> dict[str, tuple[str, int]]:
    """Each checkpoint module -> (our module, part): layers.3.self_attn.k_proj -> (layers.3.self_attn.qkv_proj, 1)."""
    return {part: (name, i) for name, module in stored_modules(model)
            for i, part in enumerate(part_names(name, module))}


def checkpoint_state(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's tensors under a checkpoint's names: each fused linear's parts apart (an int4 part padded to 16
    rows, as an Int4Linear of its own shape stores it), a tied matrix once."""
    state = {}
    for name, module in stored_modules(model):
        parts = module.parts_state() if isinstance(module, Parts) else [module.state_dict()]
        for part, tensors in zip(part_names(name, module), parts):
            state.update({f"{part}.{key}": t for key, t in tensors.items()})
    return state


def checkpoint_shapes(model: Transformer) -> dict[str, tuple]:
    """The tensors a checkpoint of `model` holds, and their shapes."""
    return {name: tuple(t.shape) for name, t in checkpoint_state(model).items()}


# ---- strict loading ----

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


QUANTIZED = (Int8Linear, Int4Linear)  # the modules a float weight is quantized into as it is read


class Filler:
    """Fills a meta-device model with a checkpoint's tensors as they are read, under the names of the model the file
    holds (taken at construction; the loader then swaps in the modules it builds). finish() ties a float head and
    checks that every expected tensor came, once, and nothing is left on the meta device."""

    def __init__(self, model: Transformer, device, dtype: torch.dtype, source: str):
        self.model, self.device, self.dtype, self.source = model, device, dtype, source
        self.expected, self.slots = set(checkpoint_shapes(model)), checkpoint_modules(model)
        self.filled: set[str] = set()
        self.pending: dict[str, set[str]] = {}  # module -> its tensors still to come
        for name in self.expected:
            self.pending.setdefault(self.slots[name.rpartition(".")[0]][0], set()).add(name)

    def target(self, name: str) -> tuple[nn.Module, int, str]:
        """(module, part, tensor name) that checkpoint tensor `name` fills, recorded as filled."""
        if name not in self.expected or name in self.filled:
            raise ValueError(f"{self.source}: " + (f"tensor {name} filled twice" if name in self.filled
                                                   else f"unexpected tensor {name}"))
        self.filled.add(name)
        prefix, key = name.rsplit(".", 1)
        module, part = self.slots[prefix]
        if module == "embed_tokens" and self.model.args.tie_embeddings and isinstance(self.model.lm_head, QUANTIZED):
            module = "lm_head"  # quantize_head: the one matrix is quantized into the head (and copied back, done())
        return self.model.get_submodule(module), part, key

    def done(self, name: str, module: nn.Module) -> None:
        """After tensor `name` went into `module`: a quantized module whose tensors have all come is packed for its
        kernel at once, so no plain copies pile up; a tied quantized head first gives the embedding its copy."""
        pending = self.pending[self.slots[name.rpartition(".")[0]][0]]
        pending.discard(name)
        if pending or not isinstance(module, QUANTIZED):
            return
        if module is self.model.lm_head and self.model.args.tie_embeddings:  # the embedding: the head dequantized
            w = dequantize_state(module, module.state_dict(), "")  # from the plain buffers, before packing
            self.model.embed_tokens.weight = nn.Parameter(w.to(self.dtype), requires_grad=False)
        module.pack_for_kernel()

    def put(self, name: str, t: torch.Tensor) -> None:
        """A tensor as the checkpoint stores it: a float weight of a quantized linear is quantized as it is read;
        any other float tensor cast to dtype; quantized codes (integers) kept as they are."""
        module, part, key = self.target(name)
        if isinstance(module, QUANTIZED) and key == "weight" and t.is_floating_point():
            module.load_part(part, module.quantize_weight(t.to(self.device)))  # plain layout, as checkpoints store it
        elif isinstance(module, Parts):
            module.load_part(part, {key: self.cast(t)})
        else:  # the embedding, norms and routers
            assert isinstance(getattr(module, key), nn.Parameter), f"{name}: {type(module).__name__}.{key}"
            setattr(module, key, nn.Parameter(self.cast(t), requires_grad=False))
        self.done(name, module)

    def cast(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=self.dtype) if t.is_floating_point() else t.to(self.device)

    def put_int4_blocks(self, name: str, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                        perm: torch.Tensor | None = None) -> None:
        """A linear's int4 codes (N, K) with a scale and zero per block, taken as they are (a GGUF's Q4 blocks,
        GPTQ/AWQ's; perm: an act-order input order)."""
        module, part, _ = self.target(name)
        buffers = module.buffers_for_codes(codes, scales, zeros, perm)
        module.load_part(part, {k: v.to(self.device) for k, v in buffers.items()})
        self.done(name, module)

    def put_mxfp4(self, name: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        """An expert linear's MXFP4 codes (formats/mxfp4.py), kept as they are (an MXFP4Linear)."""
        module, part, _ = self.target(name)
        module.load_part(part, {"blocks": blocks.to(self.device), "scales": scales.to(self.device)})
        self.done(name, module)

    def put_head_codes(self, name: str, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """The head as a GGUF's Q8_0 codes (Int8GroupLinear). A tied head's matrix is the embedding too: the loader
        puts it again, dequantized, for the embedding (which target() then records)."""
        assert isinstance(self.model.lm_head, Int8GroupLinear), type(self.model.lm_head).__name__
        if not self.model.args.tie_embeddings:
            self.target(name)
        self.model.lm_head.load_codes(codes.to(self.device), scales.to(self.device))

    def finish(self, restored: bool = False) -> Transformer:
        """restored: the model was filled whole from a weights cache entry (weightcache.py), not tensor by tensor
        through this Filler, so only the meta-device check applies."""
        model = self.model
        if model.args.tie_embeddings and isinstance(model.lm_head, nn.Linear):
            model.lm_head.weight = model.embed_tokens.weight  # one Parameter, as the model was built
        model.reset_rope(self.device)
        missing = [] if restored else sorted(self.expected - self.filled)
        on_meta = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        if missing or on_meta:
            raise ValueError(f"{self.source}: loading left tensors unfilled: missing {missing[:5]}, "
                             f"still on the meta device {on_meta[:5]}")
        return model.eval().requires_grad_(False)


def load_state(model: Transformer, state: dict[str, torch.Tensor], device="cpu",
               dtype: torch.dtype = torch.float32) -> Transformer:
    """A meta-device model filled from tensors under a checkpoint's names, strictly, as from a file."""
    check_tensors(checkpoint_shapes(model), {k: tuple(t.shape) for k, t in state.items()}, "state dict")
    filler = Filler(model, device, dtype, "state dict")
    for name, t in state.items():
        filler.put(name, t)
    return filler.finish()
