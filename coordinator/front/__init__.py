"""The front doors: what a client talks to, over the step loop.

- `gateway`: transport-neutral admission (caps, parsing, tokenizing, submit, stream, drain);
- `grpc_api`: the gRPC ``specd.v1.Generation`` API;
- `http_api`: the OpenAI-compatible HTTP API, on `http_server` (uvicorn, per-client limits),
  with its request bodies (`openai_request`), structured outputs (`openai_structured`), log
  probabilities (`openai_logprobs`) and errors (`openai_errors`);
- `tool_calls`: ``tool_choice: "auto"`` (the model's call format, its lazy grammar, the
  OpenAI ``tool_calls`` of an answer);
- `generation_request`: a request as the service takes it, checked without a tokenizer;
- `tenants`: bearer tokens, admins and cross-request state partitions.

Imports `coordinator.step`, never `coordinator.cluster`.
"""
