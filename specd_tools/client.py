"""A small synchronous client for the ``specd.v1.Generation`` API."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc

from specd.v1 import generation_pb2, generation_pb2_grpc
from specd_core.request import SpeculativeDecodeResult


def open_channel(address: str, tls_ca: str | None = None) -> grpc.Channel:
    """A channel to ``host:port``; TLS when ``tls_ca`` (a PEM file path) is given."""
    if tls_ca:
        creds = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes())
        return grpc.secure_channel(address, creds)
    return grpc.insecure_channel(address)


def stream_generate(
    address: str,
    request: generation_pb2.GenerateRequest,
    auth_token: str | None = None,
    tls_ca: str | None = None,
    timeout_s: float | None = None,
) -> Iterator[generation_pb2.GenerateResponse]:
    """Starts a ``Generate`` call: iterate it for the chunks; ``.cancel()`` stops it. The
    channel closes when the call ends.

    Raises (while iterating):
        grpc.RpcError: with the server's status (INVALID_ARGUMENT names the bad field).
    """
    metadata = [("authorization", f"Bearer {auth_token}")] if auth_token else None
    channel = open_channel(address, tls_ca)
    call = generation_pb2_grpc.GenerationStub(channel).Generate(
        request, metadata=metadata, timeout=timeout_s)
    return _Stream(channel, call)


class _Stream:
    """A streaming call that owns its channel (closed once iteration ends)."""

    def __init__(self, channel: grpc.Channel, call):
        self._channel = channel
        self._call = call

    def __iter__(self) -> Iterator[generation_pb2.GenerateResponse]:
        try:
            yield from self._call
        finally:
            self._channel.close()

    def cancel(self) -> None:
        self._call.cancel()


def get_status(address: str, auth_token: str | None = None, tls_ca: str | None = None,
               timeout_s: float | None = 10.0) -> generation_pb2.StatusResponse:
    """The service's ``Status`` (replicas, drafters, counters).

    Raises:
        grpc.RpcError: the server's status (UNAVAILABLE: nothing listens there).
    """
    metadata = [("authorization", f"Bearer {auth_token}")] if auth_token else None
    with open_channel(address, tls_ca) as channel:
        return generation_pb2_grpc.GenerationStub(channel).Status(
            generation_pb2.StatusRequest(), metadata=metadata, timeout=timeout_s)


#: Fragments of gRPC's own UNAVAILABLE text when a call reached no server, and what each
#: means to a user (checked in order).
_NO_SERVER = (("connection refused", "connection refused"),
              ("dns resolution failed", "host not found"),
              ("handshake", "TLS handshake failed"),
              ("failed to connect", "unreachable"))


def no_server_reason(exc: grpc.RpcError) -> str | None:
    """Why a call reached no server, read from gRPC's own UNAVAILABLE text: ``"connection
    refused"``, ``"host not found"``, ``"TLS handshake failed"`` or ``"unreachable"``; None
    when a server answered (its status stands, a draining server's UNAVAILABLE included)."""
    if exc.code() != grpc.StatusCode.UNAVAILABLE:
        return None
    details = (exc.details() or "").lower()
    return next((reason for fragment, reason in _NO_SERVER if fragment in details), None)


def no_server_message(address: str, exc: grpc.RpcError) -> str | None:
    """One line for a call that reached no server at ``address``, e.g. ``no specd server at
    127.0.0.1:1 (UNAVAILABLE: connection refused); start one with 'specd serve' or give its
    address with --server HOST:PORT``; None when a server answered (`no_server_reason`)."""
    reason = no_server_reason(exc)
    if reason is None:
        return None
    hint = ("is it serving TLS, and does --tls-ca name its CA?" if reason.startswith("TLS")
            else "start one with 'specd serve' or give its address with --server HOST:PORT")
    return f"no specd server at {address} ({exc.code().name}: {reason}); {hint}"


#: What a client tool says to do when the service refused its credentials.
AUTH_HINT = ("pass the service's bearer token with --auth-token, or in $SPECD_AUTH_TOKEN "
             "(which keeps it out of ps)")


def unauthenticated_message(exc: grpc.RpcError) -> str | None:
    """One line for a call the service refused as ``UNAUTHENTICATED`` (no token, or not one
    it takes), e.g. ``UNAUTHENTICATED: missing or invalid bearer token; pass the service's
    bearer token with --auth-token, ...``; None for any other status."""
    if exc.code() != grpc.StatusCode.UNAUTHENTICATED:
        return None
    return f"UNAUTHENTICATED: {exc.details() or 'no valid bearer token'}; {AUTH_HINT}"


def status_dict(status: generation_pb2.StatusResponse) -> dict:
    """``status`` as plain JSON types, every field present (proto field names), counters
    as numbers (`json_numbers`)."""
    from google.protobuf.json_format import MessageToDict

    return json_numbers(status, MessageToDict(status, preserving_proto_field_name=True,
                                              always_print_fields_with_no_presence=True))


def json_numbers(message, value: dict) -> dict:
    """``value`` (``message`` as protobuf's ``MessageToDict`` gives it, proto field names)
    with every 64-bit integer field, repeated and nested ones included, an ``int`` again:
    protobuf's JSON mapping writes them as strings (``"steps": "42"``), which a JSON reader
    would have to know to convert."""
    from google.protobuf.descriptor import FieldDescriptor as F

    wide = (F.TYPE_INT64, F.TYPE_UINT64, F.TYPE_SINT64, F.TYPE_FIXED64, F.TYPE_SFIXED64)
    for field in message.DESCRIPTOR.fields:
        if field.name not in value:
            continue
        repeated = field.is_repeated
        if field.type in wide:
            value[field.name] = ([int(v) for v in value[field.name]] if repeated
                                 else int(value[field.name]))
        elif field.type == F.TYPE_MESSAGE and not field.message_type.GetOptions().map_entry:
            items = getattr(message, field.name)
            for sub, sub_value in zip(items if repeated else [items],
                                      value[field.name] if repeated else [value[field.name]],
                                      strict=True):
                json_numbers(sub, sub_value)
    return value


def _table(headers: list[str], rows: list[list]) -> list[str]:
    cells = [headers, *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                      for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
            for r in cells]


def status_table(status: generation_pb2.StatusResponse) -> str:
    """A readable summary: the service line, then a replica table and a drafter table.
    ``tok/step`` is tokens emitted per verification step: the mean acceptance length with
    the bonus token (1.0 without drafts); ``schedule`` is the step schedule now, prefixed
    ``auto:`` where the replica chooses it by measurement, whose measurements follow the
    table (`_schedule_lines`). Drafters with a cross-request cache (suffix decoding) add its
    outputs, approximate MB and global hit rate (`_cache_cells`)."""
    s = status
    per_step = s.tokens_generated / s.steps if s.steps else 0.0
    lines = [
        f"model {s.model}   drafter {s.drafter}",
        f"requests: {s.active_requests} active, {s.waiting_requests} waiting, {s.failed} "
        f"failed   slots {s.used_slots}/{s.total_slots}   tokens {s.tokens_generated}   "
        f"steps {s.steps}   tok/step {per_step:.2f}   drafter failures {s.drafter_failures}",
        "",
    ]
    lines += _table(
        ["replica", "node", "state", "tp", "active", "prefill", "waiting", "slots", "tok/s",
         "tok/step", "step ms", "schedule", "ttft p50/p90 ms", "itl p50 ms", "prefix hits",
         "warm pos/MB", "tokens",
         "restarts", "failed"],
        [[r.name, r.node or "-", r.state, r.tp, r.active_requests, r.prefilling_requests,
          r.waiting_requests,
          f"{r.used_slots}/{r.total_slots}", f"{r.tokens_per_second:.1f}",
          f"{r.tokens_emitted / r.steps:.2f}" if r.steps else "-",
          f"{r.step_seconds * 1e3:.1f}", _schedule_cell(r),
          f"{r.ttft_p50_seconds * 1e3:.0f}/{r.ttft_p90_seconds * 1e3:.0f}",
          f"{r.itl_p50_seconds * 1e3:.0f}", f"{r.prefix_hits}/{r.prefix_queries}",
          f"{r.warm_positions}/{r.warm_bytes / 1e6:.1f}", r.tokens_emitted, r.restarts, r.failed]
         for r in s.replicas]) or ["(no replicas)"]
    lines += _schedule_lines(s.replicas)
    lines.append("")
    if s.drafters:
        headers = ["drafter", "node", "state", "calls", "errors", "mean ms", "requests",
                   "in flight", "restarts"]
        rows = [[d.name, d.node or "-", d.state, d.calls, d.errors,
                 f"{d.mean_latency_seconds * 1e3:.1f}",
                 d.assigned_requests, d.in_flight, d.restarts] for d in s.drafters]
        if any(d.has_cache for d in s.drafters):
            headers += ["cache outputs", "cache MB", "global hit rate"]
            for row, d in zip(rows, s.drafters, strict=True):
                row += _cache_cells(d) if d.has_cache else ["-"] * 3
        lines += _table(headers, rows)
    else:
        lines.append("(no drafter workers)")
    named = [t for t in s.tenants if t.name]  # none on a server without tokens
    if named:
        lines.append("")
        lines += _table(["tenant", "requests", "prompt tokens", "generated tokens"],
                        [[t.name, t.requests, t.prompt_tokens, t.generation_tokens]
                         for t in named])
    return "\n".join(lines)


def _schedule_cell(r: generation_pb2.ReplicaStatus) -> str:
    """The replica's step schedule now (``pipelined`` / ``serial``), ``auto:`` before it when
    it is chosen by measurement."""
    now = "pipelined" if r.pipeline else "serial"
    return f"auto:{now}" if r.pipeline_mode == "auto" else now


def _schedule_lines(replicas) -> list[str]:
    """One line per auto-scheduled replica that measured something: its switches and steps
    per schedule, then per active-request bucket the wall time per committed token of each
    schedule (ms; ``-`` not measured yet), the better one starred."""
    lines = []
    for r in replicas:
        if r.pipeline_mode != "auto" or not r.schedule_costs:
            continue
        cells = []
        for c in r.schedule_costs:
            parts = []
            for name in ("pipelined", "serial", "undrafted"):
                value = getattr(c, f"{name}_seconds_per_token")
                parts.append(("-" if not value else f"{value * 1e3:.3f}")
                             + ("*" if c.best == name else ""))
            cells.append(f"{c.active_requests}: {' / '.join(parts)}")
        lines.append(f"schedule of {r.name}: {r.schedule_switches} switches, "
                     f"{r.pipelined_steps} pipelined / {r.serial_steps} serial / "
                     f"{r.undrafted_steps} undrafted steps; ms per token pipelined / serial / "
                     f"undrafted by active requests: {'; '.join(cells)}")
    if lines:
        lines.insert(0, "")
    return lines


def _cache_cells(d: generation_pb2.DrafterStatus) -> list[str]:
    """A drafter's cross-request cache: outputs held, approximate MB (10^6 bytes), and its
    global hit rate (proposals drafted from previous outputs per proposal)."""
    rate = f"{100 * d.global_hits / d.proposals:.1f}%" if d.proposals else "-"
    return [str(d.cache_outputs), f"{d.cache_bytes / 1e6:.1f}", rate]


def result_from_final(final: generation_pb2.GenerateResponse | None,
                      tokens: list[int]) -> SpeculativeDecodeResult:
    """The counters of a stream's final chunk as a `SpeculativeDecodeResult`.

    Raises:
        RuntimeError: the stream ended without a final chunk.
    """
    if final is None:
        raise RuntimeError("the stream ended without a final message")
    spec = final.speculation
    return SpeculativeDecodeResult(
        generated_tokens=list(tokens),
        forward_calls=spec.forward_calls,
        tokens_generated=final.usage.completion_tokens,
        verification_steps=spec.verification_steps,
        drafted_tokens=spec.drafted_tokens,
        accepted_tokens=spec.accepted_tokens,
        evaluated_at_position=list(spec.evaluated_at_position),
        accepted_at_position=list(spec.accepted_at_position),
        finish_reason=final.finish_reason or None,
    )
