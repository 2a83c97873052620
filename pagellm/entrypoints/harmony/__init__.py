"""Entrypoints stage: the harmony response format (gpt-oss): rendering conversations, parsing outputs."""
