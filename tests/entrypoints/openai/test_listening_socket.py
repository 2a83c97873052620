"""The server's listening socket: its connections send without Nagle's algorithm.

With Nagle on, a response's body (a second small write after the headers) waited for the
client's delayed ACK: 40 ms on every request after a connection's first. asyncio turns
Nagle off only on sockets created as TCP (proto IPPROTO_TCP); the check here is on the
option itself, not on a timing."""

from __future__ import annotations

import asyncio
import socket

import pytest

from pagellm.entrypoints.openai.api_server import bind_socket
from pagellm.errors import ConfigError


def test_accepted_connections_have_tcp_nodelay():
    listener = bind_socket("127.0.0.1", 0)
    port = listener.getsockname()[1]
    options: list[int] = []

    class Probe(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            sock = transport.get_extra_info("socket")
            options.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def serve_one() -> None:
        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
        async with server:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            await reader.read()  # the server closes it
            writer.close()

    asyncio.run(serve_one())
    assert options and options[0] != 0


def test_a_port_in_use_is_a_clear_error():
    first = bind_socket("127.0.0.1", 0)
    with pytest.raises(ConfigError, match="cannot listen on 127.0.0.1"):
        bind_socket("127.0.0.1", first.getsockname()[1])
    first.close()
