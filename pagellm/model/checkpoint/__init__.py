"""Model stage: read a checkpoint's metadata (where it is, its config, its tokenizer, the
architecture names) with no torch: the simulator and the data-parallel router use this
without loading the model stack. The weights are model/loader/'s."""

from pagellm.config.model import ModelSource
from pagellm.model.checkpoint.sources import load_model_config, load_tokenizer, resolve_model_source

__all__ = ["ModelSource", "load_model_config", "load_tokenizer", "resolve_model_source"]
