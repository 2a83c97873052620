"""Entrypoints stage: HTTP: the server's routes, one APIRouter module per route group.

A handler finds what serves it on the app (`services_of(request)`, set by build_app), so
a route group is declared once, as a module, whatever app includes it:

  status.py       /health, /metrics, /v1/models
  completions.py  /v1/completions, /v1/chat/completions
  responses.py    /v1/responses and a stored response's routes
  messages.py     /v1/messages, /v1/messages/count_tokens (Anthropic)
  embeddings.py   /v1/embeddings, /v1/score, /v1/rerank (and the aliases clients use)
  dashboard.py    /v1/engine/state, /dashboard (the page: the data-parallel router's too)
  tokens.py       /tokenize, /detokenize

The Files and Batch API and the LoRA adapter routes are serving_batch.py's and
serving_lora.py's.
"""
