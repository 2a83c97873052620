"""Model stage: the weight loaders (model_loader.py builds and fills a model; gguf_loader.py and
hf_loader.py read the weights). A checkpoint's metadata is model/checkpoint/'s, re-exported here."""

from pagellm.config.model import ModelSource
from pagellm.model.checkpoint.sources import load_model_config, load_tokenizer, resolve_model_source
from pagellm.model.loader.model_loader import describe_weight_bytes, load_model, model_parameter_count

__all__ = [
    "ModelSource",
    "describe_weight_bytes",
    "load_model",
    "load_model_config",
    "load_tokenizer",
    "model_parameter_count",
    "resolve_model_source",
]
