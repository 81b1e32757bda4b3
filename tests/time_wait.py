"""TCP TIME_WAIT for tests: connections a server closes first, and counting them."""

from __future__ import annotations

import http.client
import socket


def time_wait_on(port: int) -> int:
    """TCP sockets in TIME_WAIT whose local port is ``port`` (``/proc/net/tcp``, ``tcp6``):
    left by connections the side owning ``port`` closed first."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            next(rows)  # the header
            for row in rows:
                fields = row.split()
                if fields[3] == "06" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    count += 1
    return count


def closed_by_the_server(host: str, port: int) -> None:
    """A raw TCP connection the server at ``host:port`` closes first (it reads an HTTP/1.1
    request: a gRPC server refuses it, an HTTP server is told ``Connection: close``); read
    until the server's close, so the TIME_WAIT is on the server's side."""
    with socket.create_connection((host, port), timeout=60) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        while sock.recv(65536):
            pass


def http_closed_by_the_server(host: str, port: int) -> int:
    """A ``GET /health`` with ``Connection: close`` (the server closes first); its status."""
    conn = http.client.HTTPConnection(host, port, timeout=60)
    try:
        conn.request("GET", "/health", headers={"Connection": "close"})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()
