"""Model stage: find a checkpoint (GGUF file or HF folder) and read its config and tokenizer, without torch."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pagellm.config.model import ModelConfig, ModelSource
from pagellm.errors import ModelLoadError
from pagellm.model.checkpoint import gguf_reader
from pagellm.model.checkpoint.default_model import DEFAULT_MODEL_NAME, default_model_path
from pagellm.model.checkpoint.gguf_metadata import gguf_model_config
from pagellm.model.checkpoint.hf_config import hf_model_config

if TYPE_CHECKING:
    from pagellm.tokenizer import Tokenizer


def resolve_model_source(model: str | None) -> ModelSource:
    """Turn --model (None = the embedded default) into a checkpoint on disk."""
    if model is None:
        return ModelSource("gguf", default_model_path(), DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model path {model!r} does not exist (pagellm loads local GGUF files and HF "
            "checkpoint folders; it never downloads from a hub)"
        )
    if path.is_file():
        return ModelSource("gguf", path, path.stem)
    if (path / "config.json").is_file():
        return ModelSource("hf", path, path.name)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource("gguf", ggufs[0], ggufs[0].stem)
    if len(ggufs) > 1:
        raise ModelLoadError(
            f"{path} holds several GGUF files ({', '.join(p.name for p in ggufs)}); "
            "pass the file itself"
        )
    raise ModelLoadError(f"{path} holds neither config.json (HF checkpoint) nor a .gguf file")


def load_model_config(source: ModelSource) -> ModelConfig:
    if source.format == "gguf":
        return gguf_model_config(gguf_reader.open_gguf(source.path), source.path)
    return hf_model_config(source.path)


def load_tokenizer(source: ModelSource, config: ModelConfig) -> Tokenizer:
    from pagellm.tokenizer.gguf_tokenizer import read_gguf_tokenizer_fields, tokenizer_from_gguf_metadata
    from pagellm.tokenizer.hf_tokenizer import tokenizer_from_hf_folder

    if source.format == "gguf":
        reader = gguf_reader.open_gguf(source.path)
        tokenizer = tokenizer_from_gguf_metadata(read_gguf_tokenizer_fields(reader))
    else:
        tokenizer = tokenizer_from_hf_folder(source.path)
    return tokenizer.with_extra_eos_token_ids(config.eos_token_ids)
