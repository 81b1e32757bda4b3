"""Failures that belong to one request, and how they reach its client.

The scheduler puts one of these on a request's event queue when it fails that request alone
(its own bad input, a numeric edge, a target replica that died under it); the front ends map
``code`` to their status (gRPC `grpc.StatusCode` by name) and send ``str(exc)``, which never
carries internals (pids, actor ids, node addresses): those go to the server log. Any other
exception on the queue is reported as ``INTERNAL`` with a generic message.
"""

from __future__ import annotations


class RequestError(Exception):
    """One request failed; the message is safe to show its client.

    Attributes:
        code: the gRPC status name the front end answers with.
    """

    code = "INTERNAL"


class RequestInvalid(RequestError):
    """The request's own input cannot be served (found after admission)."""

    code = "INVALID_ARGUMENT"


class RequestFailed(RequestError):
    """Serving the request raised an unexpected error (a bug, a numeric edge); this request
    alone failed. The message is generic: the cause is in the server log."""

    code = "INTERNAL"


class ReplicaUnavailable(RequestError):
    """The target replica serving the request failed or stopped answering; a retry may land
    on a healthy one."""

    code = "UNAVAILABLE"


class ServiceStopping(RequestError):
    """The service is shutting down."""

    code = "UNAVAILABLE"


def client_status(exc: BaseException) -> tuple[str, str]:
    """``(gRPC status name, client-safe message)`` for an exception that ended a request."""
    if isinstance(exc, RequestError):
        return exc.code, str(exc)
    return "INTERNAL", "generation failed: internal error (the server log has the details)"


__all__ = ["ReplicaUnavailable", "RequestError", "RequestFailed", "RequestInvalid",
           "ServiceStopping", "client_status"]
