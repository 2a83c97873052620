"""Tokenizer stage: tokenizers (GGUF metadata or HF folder) and chat templates."""

from pagellm.tokenizer.chat_template import render_chat_template, validate_messages
from pagellm.tokenizer.gguf_tokenizer import (
    read_gguf_tokenizer_fields,
    tokenizer_from_gguf_file,
    tokenizer_from_gguf_metadata,
)
from pagellm.tokenizer.hf_tokenizer import tokenizer_from_hf_folder
from pagellm.tokenizer.tokenizer import Tokenizer

__all__ = [
    "Tokenizer",
    "read_gguf_tokenizer_fields",
    "render_chat_template",
    "tokenizer_from_gguf_file",
    "tokenizer_from_gguf_metadata",
    "tokenizer_from_hf_folder",
    "validate_messages",
]
