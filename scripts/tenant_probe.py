"""Probes what a second client learns from a first one's requests (issue 31's table): run it
against a `specd serve --http-port PORT` with two tenant tokens, greedy, default drafter.

    specd serve --http-port 8000 --auth-token tok-a --auth-token tok-b &
    python scripts/tenant_probe.py --url http://127.0.0.1:8000 --token-a tok-a --token-b tok-b

For each of ``--trials`` fresh random secrets it sends, through the OpenAI chat API:

- **fresh**: B sends a secret-bearing request nobody sent before (what a fresh server, or a
  partition that never saw it, answers);
- **after A**: A sends another secret's request, then B sends A's very request;
- **A again**: A repeats its own request (the gain a tenant keeps from its own cache);

and prints, per probe, the mean and standard deviation of the response's
``speculation.forward_calls``, ``acceptance_length`` and wall seconds, and how many trials
one request tells apart (B's forward calls after A below every fresh value). Then the memo
probe: A sends a long memo with one question; B sends the same memo with another; A sends it
with a third: time to first token and ``usage.prompt_tokens_details.cached_tokens`` (absent:
-1) of each.

Without tenants (one shared cache) "after A" reads fewer forward calls than "fresh"; with
them B's numbers equal a fresh request's while "A again" still gains.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import time

try:  # the openai client's HTTP library (renamed httpx2 in its newer releases)
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

MEMO = ("Internal memo, quarter planning. " + " ".join(
    f"Item {i}: the {w} team ships milestone {i} after review by the {v} group, with "
    f"budget line {100 + 7 * i} and owner code {w[:3].upper()}{i:02d}."
    for i, (w, v) in enumerate(zip(
        ["data", "infra", "mobile", "search", "ads", "billing", "growth", "safety"] * 2,
        ["legal", "finance", "design", "security", "privacy", "ops", "sales", "hr"] * 2,
        strict=True))))


def secret_request(secret: str) -> list[dict]:
    return [{"role": "user", "content": f"My access code is {secret}. Reply with exactly this "
                                        f"sentence: The access code is {secret}, keep it safe."}]


def chat(http, model: str, token: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed greedy chat request: ``{"forward_calls", "acceptance_length", "seconds",
    "ttft", "cached_tokens"}``."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    began = time.perf_counter()
    out = {"ttft": None, "cached_tokens": -1}
    with http.stream("POST", "/v1/chat/completions", json=body,
                     headers={"Authorization": f"Bearer {token}"}) as r:
        if r.status_code != 200:
            raise SystemExit(f"HTTP {r.status_code}: {r.read().decode()}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise SystemExit(f"stream failed: {chunk['error']}")
            for c in chunk.get("choices", ()):
                if out["ttft"] is None and c.get("delta", {}).get("content"):
                    out["ttft"] = time.perf_counter() - began
            if chunk.get("speculation"):
                spec = chunk["speculation"]
                out["forward_calls"] = spec["forward_calls"]
                out["acceptance_length"] = spec["acceptance_length"]
            if chunk.get("usage"):
                details = chunk["usage"].get("prompt_tokens_details") or {}
                out["cached_tokens"] = details.get("cached_tokens", -1)
    out["seconds"] = time.perf_counter() - began
    return out


def summary(rows: list[dict], key: str) -> str:
    values = [r[key] for r in rows]
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.2f} ± {sd:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--token-a", required=True)
    parser.add_argument("--token-b", required=True)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=40)
    args = parser.parse_args()
    probes: dict[str, list[dict]] = {"fresh": [], "after A": [], "A again": []}
    with httpx.Client(base_url=args.url, timeout=600) as http:
        chat(http, args.model, args.token_a, secret_request("warm-up"), args.max_tokens)
        for _ in range(args.trials):
            fresh, theirs = secrets.token_hex(12), secrets.token_hex(12)
            probes["fresh"].append(chat(http, args.model, args.token_b,
                                        secret_request(fresh), args.max_tokens))
            chat(http, args.model, args.token_a, secret_request(theirs), args.max_tokens)
            probes["after A"].append(chat(http, args.model, args.token_b,
                                          secret_request(theirs), args.max_tokens))
            probes["A again"].append(chat(http, args.model, args.token_a,
                                          secret_request(theirs), args.max_tokens))
        print(f"{'probe':10} {'forward calls':>16} {'acceptance length':>18} {'seconds':>14}")
        for name, rows in probes.items():
            print(f"{name:10} {summary(rows, 'forward_calls'):>16} "
                  f"{summary(rows, 'acceptance_length'):>18} {summary(rows, 'seconds'):>14}")
        lowest_fresh = min(r["forward_calls"] for r in probes["fresh"])
        told = sum(r["forward_calls"] < lowest_fresh for r in probes["after A"])
        print(f"trials one request tells apart (B after A below every fresh value): "
              f"{told}/{args.trials}")
        tag = secrets.token_hex(4)  # a memo nobody sent before
        memo = [[{"role": "user", "content": f"[{tag}] {MEMO}\n\nQuestion: {q}"}] for q in (
            "Which team owns item 3?", "What is the budget line of item 5?",
            "Who reviews item 7?")]
        for who, token, messages in (("A first", args.token_a, memo[0]),
                                     ("B same memo", args.token_b, memo[1]),
                                     ("A same memo", args.token_a, memo[2])):
            r = chat(http, args.model, token, messages, 8)
            print(f"memo {who:12} ttft {r['ttft']:.2f} s   cached_tokens {r['cached_tokens']}")


if __name__ == "__main__":
    main()
