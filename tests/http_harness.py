"""What the HTTP API's tests share: a service whose target can be held mid-generation, its
token, and helpers for raw requests and OpenAI-shaped errors."""

from __future__ import annotations

import asyncio
import json

from service_harness import LocalService

from coordinator.step.targets import LocalTarget

try:  # the HTTP library the installed openai client uses
    import httpx2 as httpx
except ImportError:  # openai < 3
    import httpx

#: The chat every test sends unless it needs another.
MESSAGES = [{"role": "user", "content": "abcabcabcabc"}]

TOKEN = "s3cret-token"


class GatedTarget(LocalTarget):
    """A target whose verify calls wait while ``gate`` is clear (the test holds a request
    mid-generation, deterministically)."""

    def __init__(self, engine, gate: asyncio.Event):
        super().__init__(engine)
        self.gate = gate

    async def verify(self, items: list) -> list:
        await self.gate.wait()
        return await super().verify(items)


class GatedService(LocalService):
    async def _start_replica(self, name: str):
        self.gate = asyncio.Event()
        self.gate.set()
        target, stop, info = await super()._start_replica(name)
        return GatedTarget(target.engine, self.gate), stop, info


def post_raw(service, content: bytes, path: str = "/v1/chat/completions"):
    """POSTs ``content`` as is (no client-side JSON) with the service's token."""
    return httpx.post(f"http://{service.http_address}{path}", content=content, timeout=30,
                      headers={"Authorization": f"Bearer {TOKEN}",
                               "Content-Type": "application/json"})


def openai_error(response, status: int) -> dict:
    """The ``error`` object of an OpenAI-shaped error answer with ``status`` (asserted)."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def sse_events(base: str, path: str, body: dict, token: str | None = TOKEN) -> list:
    """The parsed ``data:`` events of a streamed request ("[DONE]" kept as the string)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    events = []
    with httpx.stream("POST", f"http://{base}{path}", json=body, headers=headers,
                      timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events
