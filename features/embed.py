"""Text embeddings from a decoder LM: each sequence's final hidden states (after the last norm, where the LM head
would read them), pooled to one vector and L2-normalized. No KV cache: one uncached forward per sequence through
the model's own layers (Transformer.forward less its head), so nothing the engine holds is touched."""
import torch
import torch.nn.functional as F

from model import Transformer

# mean: the average over every token's state, the common choice for a decoder LM without an embedding head (a
# base or chat model's last state is shaped to predict the next token, not to sum up the text). last: the final
# token's state, which attends to the whole text; what models trained for it use (e5-mistral, gte-Qwen2).
POOLINGS = ("mean", "last")


def hidden_states(model: Transformer, ids: list[int]) -> torch.Tensor:
    """The final norm's output for one sequence: float32 (T, C), from an uncached forward over all T tokens."""
    tokens = torch.tensor([ids], device=model.embed_tokens.weight.device)  # (1, T)
    pos = torch.arange(len(ids), device=tokens.device)  # (T,)
    x, cos, sin, mask = model.inputs(tokens, pos, None)  # mask (T, T): causal over these tokens
    for layer in model.layers:
        x = layer(x, pos, cos, sin, mask, None)  # (1, T, C)
    return model.norm(x)[0].float()  # (T, C)


def pool(hidden: torch.Tensor, pooling: str) -> torch.Tensor:
    """(T, C) hidden states -> one unit-norm (C,) vector: their mean, or the last one."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    vector = hidden.mean(dim=0) if pooling == "mean" else hidden[-1]  # (C,)
    return F.normalize(vector, dim=0)


@torch.inference_mode()
def embed(model: Transformer, inputs: list[list[int]], pooling: str = "mean") -> list[list[float]]:
    """One unit-norm vector (of model.args.dim floats) per token sequence; sequences run one at a time, so their
    lengths differ freely and each vector depends on its own tokens alone."""
    if any(not ids for ids in inputs):
        raise ValueError("cannot embed an empty token sequence")
    return [pool(hidden_states(model, ids), pooling).tolist() for ids in inputs]
