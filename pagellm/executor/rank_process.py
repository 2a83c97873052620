"""Executor stage: the entry point of one tensor-parallel rank's process (`mp` executor).

`MultiprocExecutor` starts `python -P -m pagellm.executor.rank_process --fd N`, as torchrun
and Ray start their workers through their own code: the user's `__main__` is never
imported here, so a plain script without an `if __name__ == "__main__":` guard can build
`LLM(tensor_parallel_size=N)`. Descriptor N is this rank's end of a socket pair with the
driver: its `RankSetup` arrives on it, the rank answers with a `RankLoaded` (ready, or the
error that stopped it) before it joins the process group, and it stays open for the
process's life, so the driver sees the rank exit as the end of that connection.
"""

from __future__ import annotations

import argparse
import logging
import os
from multiprocessing.connection import Connection

from pagellm.executor.multiproc import RankLoaded, RankSetup
from pagellm.executor.worker_loop import serve_driver
from pagellm.worker.worker import Worker


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="One non-driver tensor-parallel rank (started by the engine).")
    parser.add_argument("--fd", type=int, required=True, help="this rank's end of its connection to the driver")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("PAGELLM_WORKER_LOG_LEVEL", "WARNING"))
    # Kept from this rank's own children (compilers, Triton), so the connection ends
    # exactly when this process does.
    os.set_inheritable(args.fd, False)
    driver = Connection(args.fd)
    setup = driver.recv()
    assert isinstance(setup, RankSetup)
    try:
        worker = Worker(setup.config, setup.rank, setup.device)
    except BaseException as e:  # noqa: BLE001 - reported to the driver, then this rank ends
        driver.send(RankLoaded(error=f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from None
    driver.send(RankLoaded())
    serve_driver(worker, setup.init_method)
    driver.close()


if __name__ == "__main__":
    main()
