"""Executor stage: what a non-driver rank does once its model share is loaded: join the
group, size the cache with the others, then execute whatever the driver broadcasts."""

from __future__ import annotations

import logging
import socket

from pagellm.worker.worker import StepMessage, Worker

logger = logging.getLogger(__name__)

# Messages the driver broadcasts: (kind, payload).
INIT_CACHE = "init_cache"  # payload: (num_gpu_blocks, num_cpu_blocks)
STEP = "step"  # payload: StepMessage
SHUTDOWN = "shutdown"  # payload: None


def serve_driver(worker: Worker, init_method: str) -> None:
    """Run rank `worker.rank` until the driver says shutdown (or dies: its collectives
    then fail and the error ends this rank too)."""
    worker.connect(init_method)
    assert worker.tp is not None
    worker.cache_size()  # collective: the driver takes the minimum over ranks
    try:
        while True:
            kind, payload = worker.tp.broadcast_from_driver()
            if kind == STEP:
                assert isinstance(payload, StepMessage)
                worker.execute_model(payload.scheduler_output, payload.sampled_token_ids)
            elif kind == INIT_CACHE:
                worker.init_cache(*payload)
            elif kind == SHUTDOWN:
                logger.debug("rank %d: shutdown", worker.rank)
                return
            else:
                raise RuntimeError(f"unknown driver message {kind!r}")
    finally:
        worker.close()


def local_init_method() -> str:
    """A tcp:// rendezvous address on this host, on a port free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"tcp://127.0.0.1:{port}"
