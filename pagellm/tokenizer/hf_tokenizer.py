"""Tokenizer stage: load the tokenizer of a Hugging Face checkpoint folder.

The folder's tokenizer.json is the whole tokenizer (the `tokenizers` library reads it);
tokenizer_config.json adds what it lacks: which tokens are BOS/EOS/PAD and the chat
template (which newer checkpoints keep in chat_template.jinja).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tokenizers

from pagellm.errors import ModelLoadError
from pagellm.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
DEFAULT_TEMPLATE_NAME = "default"


def tokenizer_from_hf_folder(path: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer of the HF checkpoint folder at `path`."""
    folder = Path(path)
    backend = _load_backend(folder / TOKENIZER_FILE)
    config = _load_config(folder / TOKENIZER_CONFIG_FILE)

    def token_id(name: str) -> int | None:
        token = special_token_text(config.get(name))
        if token is None:
            return None
        token_id = backend.token_to_id(token)
        if token_id is None:
            logger.warning("%s %r in %s is not in the vocabulary; ignoring it", name, token, folder)
        return token_id

    chat_template, named_templates = _chat_templates(folder, config)
    tokenizer = Tokenizer(
        backend,
        bos_token_id=token_id("bos_token"),
        eos_token_id=token_id("eos_token"),
        pad_token_id=token_id("pad_token"),
        unk_token_id=token_id("unk_token"),
        # tokenizer.json's post-processor decides whether BOS/EOS are added (None = keep
        # it); transformers 5 likewise ignores the config's add_bos_token/add_eos_token
        # when a tokenizer.json is present.
        add_bos_token=None,
        add_eos_token=None,
        chat_template=chat_template,
        named_chat_templates=named_templates,
        clean_up_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
    )
    for flag in ("add_bos_token", "add_eos_token"):
        stated = config.get(flag)
        if stated is not None and bool(stated) != getattr(tokenizer, flag):
            logger.warning(
                "%s says %s=%s but its tokenizer.json does otherwise; following tokenizer.json",
                folder / TOKENIZER_CONFIG_FILE,
                flag,
                stated,
            )
    return tokenizer


def special_token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ModelLoadError(f"cannot read special token {value!r} in {TOKENIZER_CONFIG_FILE}")


def _load_backend(file: Path) -> tokenizers.Tokenizer:
    if not file.is_file():
        raise ModelLoadError(
            f"{file.parent} has no {TOKENIZER_FILE}; pagellm loads fast-tokenizer files only "
            "(save the tokenizer with a recent transformers/tokenizers to create one)"
        )
    try:
        return tokenizers.Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust parser raises a plain Exception on bad JSON or fields
        raise ModelLoadError(f"{file} is not a valid tokenizer file: {e}") from None


def _load_config(file: Path) -> dict[str, Any]:
    if not file.is_file():
        logger.info("%s not found; no special tokens or chat template beyond tokenizer.json", file)
        return {}
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{file} is not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{file} must hold a JSON object")
    return config


def _chat_templates(folder: Path, config: Mapping[str, Any]) -> tuple[str | None, dict[str, str]]:
    """(the default chat template, the named ones) of a checkpoint.

    The template is in chat_template.jinja (newer checkpoints; it wins) or in the config's
    "chat_template": a string, or a list of {"name", "template"} of which "default" is used.
    """
    named: dict[str, str] = {}
    default: str | None = None
    value = config.get("chat_template")
    if isinstance(value, str):
        default = value
    elif isinstance(value, list):
        for entry in value:
            if not (isinstance(entry, Mapping) and isinstance(entry.get("name"), str)):
                raise ModelLoadError(f"chat_template entries in {TOKENIZER_CONFIG_FILE} need a name and a template")
            named[entry["name"]] = str(entry.get("template", ""))
        default = named.get(DEFAULT_TEMPLATE_NAME)
        if default is None:
            logger.warning(
                "%s lists chat templates %s but none named %r; chat needs one chosen by name",
                folder,
                sorted(named),
                DEFAULT_TEMPLATE_NAME,
            )
    elif value is not None:
        raise ModelLoadError(f"chat_template in {TOKENIZER_CONFIG_FILE} must be a string or a list")
    jinja_file = folder / CHAT_TEMPLATE_FILE
    if jinja_file.is_file():
        try:
            default = jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"cannot read {jinja_file}: {e}") from None
    return default, named
