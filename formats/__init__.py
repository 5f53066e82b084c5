"""Checkpoint file formats: GGUF, Hugging Face folders, GPTQ/AWQ packing, vocabularies, the weights cache."""
