"""Entrypoints stage: `pagellm serve --data-parallel-size M`, M engine replicas behind one
API server: the replicas (replicas.py), the router that picks one per request
(router.py) and the server in front (server.py)."""
