"""Bench stage: an HF checkpoint folder written from a GGUF file, for peers that read no GGUF.

vLLM's CPU build loads HF folders only, so the GGUF every other backend runs is loaded by
transformers (its weights dequantized to float32, its tokenizer rebuilt from the GGUF's
vocabulary) and saved once with `save_pretrained`. The folder is kept under the cache
folder, keyed by the GGUF's name, size and modification time: a changed file gets a new
folder, an unchanged one is converted only once.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from pagellm.errors import PagellmError

logger = logging.getLogger(__name__)

CACHE_VARIABLE = "PAGELLM_CACHE_DIR"
# Written last: a folder without it is an interrupted conversion, never handed out.
DONE_MARKER = "pagellm-converted-from.txt"


def cache_root() -> Path:
    """pagellm's cache folder ($PAGELLM_CACHE_DIR or ~/.cache/pagellm)."""
    return Path(os.environ.get(CACHE_VARIABLE) or Path.home() / ".cache" / "pagellm")


def hf_folder_path(gguf_path: Path, cache: Path | None = None) -> Path:
    """Where the HF folder of `gguf_path` is (or will be) kept."""
    stat = gguf_path.stat()
    return (cache or cache_root()) / "hf" / f"{gguf_path.stem}-{stat.st_size}-{int(stat.st_mtime)}"


def hf_folder_from_gguf(gguf_path: Path, cache: Path | None = None) -> Path:
    """The HF folder (config, float32 safetensors, tokenizer) of `gguf_path`, written on
    first use and reused after."""
    if not gguf_path.is_file():
        raise PagellmError(f"no GGUF file at {gguf_path}")
    target = hf_folder_path(gguf_path, cache)
    if (target / DONE_MARKER).exists():
        return target
    # A sibling folder renamed into place: a concurrent or interrupted writer never leaves
    # a half-written folder under the final name.
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        write_hf_folder(gguf_path, partial)
        (partial / DONE_MARKER).write_text(f"{gguf_path.resolve()}\n")
        shutil.rmtree(target, ignore_errors=True)  # an interrupted earlier attempt
        try:
            os.replace(partial, target)
        except OSError:
            if not (target / DONE_MARKER).exists():  # else a concurrent writer came first
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    logger.info("wrote the HF folder of %s to %s", gguf_path, target)
    return target


def write_hf_folder(gguf_path: Path, folder: Path) -> None:
    """transformers' own reading of the GGUF (model in float32, tokenizer), saved to `folder`."""
    import torch
    import transformers

    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except (OSError, ValueError, KeyError) as e:
        raise PagellmError(f"transformers cannot turn {gguf_path} into an HF folder: {e}") from e
    # transformers dequantizes a GGUF as it loads it but keeps its GGUF "quantizer", which
    # refuses to save; the weights are plain float32 tensors by now, saved as such.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
