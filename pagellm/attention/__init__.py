"""Attention stage: backends that read and write the paged KV cache."""

from pagellm.attention.backend import AttentionBackend, AttentionMetadata
from pagellm.attention.selector import get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
