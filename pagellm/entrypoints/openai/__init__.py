"""Entrypoints (HTTP): the OpenAI-compatible server (`pagellm serve`)."""
