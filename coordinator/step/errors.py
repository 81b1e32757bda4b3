"""Failures that belong to one request, and how they reach its client.

The scheduler puts one of these on a request's event queue when it fails that request alone
(its own bad input, a numeric edge, a target replica that died under it); the front ends map
``code`` to their status (gRPC `grpc.StatusCode` by name) and send ``str(exc)``, which never
carries internals (pids, actor ids, node addresses): those go to the server log. Any other
exception on the queue is reported as ``INTERNAL`` with a generic message.
"""

from __future__ import annotations

#: What a client sees when its request failed inside the service (the cause goes to the log).
REQUEST_FAILED = ("generation failed: internal error while serving this request (the server "
                  "log has the details)")
#: What a client whose request was on a failed target replica is told (no pids, ids or
#: addresses): the one message for that failure, with or without supervision restarting it.
REPLICA_FAILED = "the target replica serving this request failed; a retry may succeed"


class RequestError(Exception):
    """One request failed; the message is safe to show its client.

    Attributes:
        code: the gRPC status name the front end answers with.
    """

    code = "INTERNAL"


class RequestInvalid(RequestError):
    """The request's own input cannot be served.

    Args:
        message: the client-safe text. With ``field``, a `str.format` template in which
            ``{field}`` stands for the field's name (literal braces doubled, see `literal`),
            so that each front end can name the field in its own terms (`naming`).
        field: the offending request field as the service names it: the gRPC API's field
            path (``"max_new_tokens"``, ``"sampling.top_p"``, ``"stop"``, ``"chat"``,
            ``"prompt"`` for the prompt as a whole, ...), or None when no one field is at
            fault. ``str(exc)`` names it so.

    Attributes:
        field: as above.
    """

    code = "INVALID_ARGUMENT"

    def __init__(self, message: str, field: str | None = None):
        self.field = field
        self._template = message
        super().__init__(message if field is None else message.format(field=field))

    def naming(self, name: str) -> str:
        """The message with the field called ``name`` (a front end's term for `field`)."""
        if self.field is None:
            return str(self)
        return self._template.format(field=name)


def literal(text: str) -> str:
    """``text`` (a client's value, a library's message) as literal text of a `RequestInvalid`
    template."""
    return text.replace("{", "{{").replace("}", "}}")


class RequestFailed(RequestError):
    """Serving the request raised an unexpected error (a bug, a numeric edge); this request
    alone failed. The message is generic: the cause is in the server log."""

    code = "INTERNAL"


class ReplicaUnavailable(RequestError):
    """The target replica serving the request failed or stopped answering; a retry may land
    on a healthy one."""

    code = "UNAVAILABLE"


class RateLimited(RequestError):
    """The client sent more than its share of something costly (refused constraints,
    `coordinator.front.refusals.RefusalBudget`); a retry after ``retry_after_s`` may succeed.

    Attributes:
        retry_after_s: seconds until a retry can succeed.
    """

    code = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ServiceStopping(RequestError):
    """The service is shutting down."""

    code = "UNAVAILABLE"


def client_status(exc: BaseException) -> tuple[str, str]:
    """``(gRPC status name, client-safe message)`` for an exception that ended a request."""
    if isinstance(exc, RequestError):
        return exc.code, str(exc)
    return "INTERNAL", "generation failed: internal error (the server log has the details)"


__all__ = ["REPLICA_FAILED", "REQUEST_FAILED", "RateLimited", "ReplicaUnavailable",
           "RequestError",
           "RequestFailed", "RequestInvalid", "ServiceStopping", "client_status", "literal"]


class ReplicaFailed(Exception):
    """A target call found its replica dead or unresponsive. Internal: the message (which may
    carry Ray's pid / actor id / address) goes to the log; clients get `ReplicaUnavailable`."""
