"""Executor stage: where the workers run (this process, worker processes, Ray actors)."""
