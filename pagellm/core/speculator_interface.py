"""Core stage: what the scheduler asks of a speculative-decoding proposer (spec_decode/ has one)."""

from __future__ import annotations

from typing import Protocol

from pagellm.request import Request


class Speculator(Protocol):
    def active(self, num_running: int) -> bool:
        """Whether this step speculates at all."""

    def propose(self, request: Request) -> list[int]:
        """Tokens to verify after the request's next one ([]: none)."""

    def record(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        """One verification's outcome."""

    def finished(self, request_id: str) -> None:
        """The request left the engine: forget what was kept for it."""
