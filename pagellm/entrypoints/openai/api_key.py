"""Entrypoints stage: CLI: where `pagellm serve` finds its API key when --api-key is not given.

`pagellm serve` reads this environment variable, and the data-parallel router sets it for
the replicas it starts (each a `pagellm serve` of its own), so that the key never shows
on their command lines. A module of its own, importing nothing: the command stays free
of web frameworks, and the router need not import the command that starts it.
"""

API_KEY_ENV = "PAGELLM_API_KEY"
