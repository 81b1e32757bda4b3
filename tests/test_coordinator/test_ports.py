"""Binding and probing API ports: a stopped server's TIME_WAIT connections do not block a
restart on its port (``SO_REUSEADDR``, as the servers themselves bind), a live listener
still does, and the refusal names the setting."""

from __future__ import annotations

import asyncio
import socket

import pytest
from time_wait import time_wait_on

from coordinator.cluster.service import check_port_free
from coordinator.front.http_api import OpenAIApi
from coordinator.front.http_server import start_http_server


def port_in_time_wait() -> int:
    """A loopback port nothing listens on, with a connection in TIME_WAIT on it: the
    listener accepted one, closed it first, then stopped. The listener binds as specd's
    servers do, with ``SO_REUSEADDR``: Linux lets a new bind over a TIME_WAIT connection
    only when both sockets set it."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        served, _ = listener.accept()
        served.close()  # the server's side closes first: TIME_WAIT is on `port`
        assert client.recv(1) == b""
        client.close()
    assert time_wait_on(port) >= 1
    with socket.socket() as plain, pytest.raises(OSError):  # what failed a restart before
        plain.bind(("127.0.0.1", port))
    return port


def test_the_port_probe_passes_a_port_in_time_wait_and_refuses_a_live_one():
    port = port_in_time_wait()
    check_port_free("127.0.0.1", port, "http_port")
    with socket.socket() as live:
        live.bind(("127.0.0.1", 0))
        live.listen()
        taken = live.getsockname()[1]
        with pytest.raises(ValueError, match=rf"^http_port: cannot listen on 127\.0\.0\.1:"
                                             rf"{taken}: Address already in use"):
            check_port_free("127.0.0.1", taken, "http_port")


def test_the_http_server_binds_a_port_in_time_wait_and_refuses_a_live_one():
    port = port_in_time_wait()

    async def serve(at: int):
        server, bound = await start_http_server(OpenAIApi(), "127.0.0.1", at)
        await server.stop()
        return bound

    assert asyncio.run(serve(port)) == port
    with socket.socket() as live:
        live.bind(("127.0.0.1", 0))
        live.listen()
        with pytest.raises(ValueError, match="cannot listen on .*Address already in use"):
            asyncio.run(serve(live.getsockname()[1]))
