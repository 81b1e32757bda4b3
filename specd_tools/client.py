"""A small synchronous client for the ``specd.v1.Generation`` API."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc

from specd.v1 import generation_pb2, generation_pb2_grpc
from specd_core.request import SpeculativeDecodeResult
from specd_core.sampling import SamplingParams


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


def generate_request(args, sampling: SamplingParams) -> generation_pb2.GenerateRequest:
    """A GenerateRequest from ``specd generate`` arguments."""
    request = generation_pb2.GenerateRequest(
        sampling=generation_pb2.SamplingParams(
            temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
            min_p=sampling.min_p, repetition_penalty=sampling.repetition_penalty,
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty),
        max_new_tokens=args.max_new_tokens,
        stop=args.stop,
        speculation=generation_pb2.SpeculationOptions(
            enabled=args.drafter != "none", max_draft_len=args.max_draft_len),
    )
    if args.seed is not None:
        request.seed = args.seed
    if args.raw:
        request.text = args.prompt
    else:
        request.chat.messages.add(role="user", content=args.prompt)
    return request


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
