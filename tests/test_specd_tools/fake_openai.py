"""A fake OpenAI-compatible server for `specd bench serve`'s tests: streamed chat completions
with a known text, token count, chunking and timing.

Each request's answer is ``max_tokens`` tokens ``"<w><i> "`` (``w`` the prompt's first word,
``i`` from 0), sent ``tokens_per_chunk`` tokens per chunk after a role-only chunk; the first
content chunk comes ``first_delay`` seconds after the request, each later one ``gap`` seconds
after the previous; ``usage`` (prompt tokens = the prompt's words) rides on a last chunk when the
client asks for it and ``usage`` is on. A prompt starting with ``FAIL`` gets HTTP 500; one starting
with ``diff`` gets ``suffix`` appended to its text. ``app.state.bodies`` keeps every request body.

Run as a script (``python fake_openai.py --port P ...``) it serves on 127.0.0.1:P."""

from __future__ import annotations

import argparse
import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL_ID = "fake-model"


def make_app(tokens_per_chunk: int = 2, first_delay: float = 0.0, gap: float = 0.0,
             usage: bool = True, suffix: str = "") -> FastAPI:
    app = FastAPI()
    app.state.bodies = []

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": MODEL_ID, "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        app.state.bodies.append(body)
        prompt = body["messages"][-1]["content"]
        if prompt.startswith("FAIL"):
            return JSONResponse({"error": {"message": "asked to fail", "type": "server_error",
                                           "param": None, "code": None}}, status_code=500)
        word = prompt.split()[0]
        n = int(body.get("max_tokens") or 16)
        tokens = [f"{word}{i} " for i in range(n)]
        if word == "diff":
            tokens[-1] += suffix
        chunks = ["".join(tokens[i:i + tokens_per_chunk])
                  for i in range(0, n, tokens_per_chunk)]
        include = usage and (body.get("stream_options") or {}).get("include_usage")
        meta = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0,
                "model": body["model"]}

        def event(choices, **extra) -> str:
            return f"data: {json.dumps({**meta, 'choices': choices, **extra})}\n\n"

        async def stream():
            yield event([{"index": 0, "delta": {"role": "assistant", "content": ""},
                          "finish_reason": None}])
            for i, text in enumerate(chunks):
                await asyncio.sleep(first_delay if i == 0 else gap)
                yield event([{"index": 0, "delta": {"content": text}, "finish_reason": None}])
            # specd's counters ride on the finish chunk: steps of 4 tokens, 3 of them drafted.
            steps = -(-n // 4)
            yield event([{"index": 0, "delta": {}, "finish_reason": "length"}],
                        speculation={"forward_calls": steps + 1, "verification_steps": steps,
                                     "drafted_tokens": 3 * steps,
                                     "accepted_tokens": n - steps,
                                     "acceptance_length": n / steps})
            if include:
                words = len(prompt.split())
                yield event([], usage={"prompt_tokens": words, "completion_tokens": n,
                                       "total_tokens": words + n})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tokens-per-chunk", type=int, default=2)
    p.add_argument("--suffix", default="")
    args = p.parse_args()
    uvicorn.run(make_app(args.tokens_per_chunk, suffix=args.suffix), host="127.0.0.1",
                port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
