"""Benchmark workloads shipped with specd: fixed chat prompts, written for this project.

Each workload is one JSON file next to this module (``{"name", "description", "prompts":
[{"id", "messages": [{"role", "content"}, ...]}]}``):

- ``code_edit``: rewrite a given ~400-token function or class with a small change (the answer
  mostly copies the prompt: prompt lookup's best case);
- ``summarise``: quote and summarise, or copy with an edit, a given passage;
- ``chat``: multi-turn chat whose last turn asks to repeat an earlier answer with a change;
- ``open_question``: open-ended questions with little to copy (speculation's worst case).

Prompts are plain data, so a run is deterministic given the model and the decoding settings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

__all__ = [
    "WORKLOADS",
    "Prompt",
    "Workload",
    "encode_workload_prompt",
    "load_workload",
    "load_workloads",
]

#: Workload names, in the order the bench reports them.
WORKLOADS: tuple[str, ...] = ("code_edit", "summarise", "chat", "open_question")


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: ``messages`` are chat turns ``{"role", "content"}``, ending
    with the user turn the model answers."""

    id: str
    messages: tuple[dict[str, str], ...]


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    prompts: tuple[Prompt, ...]


def load_workload(name: str) -> Workload:
    """The workload called ``name`` (one of `WORKLOADS`).

    Raises:
        ValueError: an unknown name (the message lists the choices).
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choices: {', '.join(WORKLOADS)}")
    data = json.loads(resources.files(__name__).joinpath(f"{name}.json").read_text("utf-8"))
    prompts = tuple(
        Prompt(p["id"], tuple({"role": m["role"], "content": m["content"]} for m in p["messages"]))
        for p in data["prompts"]
    )
    return Workload(data["name"], data["description"], prompts)


def load_workloads(names: str | list[str] | tuple[str, ...] | None = None) -> list[Workload]:
    """Workloads by name: a list, a comma-separated string, or None for all of them.

    Raises:
        ValueError: an unknown or repeated name, or an empty selection.
    """
    if names is None:
        names = list(WORKLOADS)
    elif isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    if not names:
        raise ValueError("no workloads selected")
    if len(set(names)) != len(names):
        raise ValueError(f"a workload is named twice: {', '.join(names)}")
    return [load_workload(n) for n in names]


def encode_workload_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of a workload ``prompt`` (all its chat turns) through the model's chat template
    (`specd_core.text.encode_chat`), ending where the assistant's answer begins. (One user
    string, raw or templated, is `specd_core.text.encode_prompt`.)"""
    from specd_core.text import encode_chat

    return encode_chat(tokenizer, list(prompt.messages))
