"""Entrypoints stage: HTTP: the OpenAI-compatible server (`pagellm serve`)."""
