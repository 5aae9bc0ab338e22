"""Load a model (weights, config, tokenizer) from any supported source."""

from ember_core.loaders.load import LoadedModel, load_model

__all__ = ["LoadedModel", "load_model"]
