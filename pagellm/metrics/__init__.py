"""Metrics stage: what the engine is doing, for Prometheus, logs and people."""
