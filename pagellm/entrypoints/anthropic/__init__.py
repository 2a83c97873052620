"""Entrypoints stage: HTTP: Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens)
on the same server, so that tools written for Claude can point at pagellm."""
