"""Entrypoints stage: HTTP: Ollama's API (/api/chat, /api/generate, /api/embed, /api/tags,
/api/show, /api/ps, /api/version) on the same server, so that Ollama's clients and the
tools built for them can point at pagellm."""
