"""The model class a ModelArgs is built as: model.Transformer, or a family's own (DeepSeek's latent attention)."""
from config import ModelArgs
from model import Transformer
from models.deepseek import DeepseekTransformer


def build_model(args: ModelArgs) -> Transformer:
    """The family's Transformer for `args`, built on the current default device (loaders: the meta device)."""
    return DeepseekTransformer(args) if args.kv_lora_rank is not None else Transformer(args)
