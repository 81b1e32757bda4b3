"""The repeated-structure workload: many requests whose answers share a form while their
prompts differ (JSON extraction, SQL, small Python functions with docstrings, tool calls),
fields drawn from fixed lists with a seeded generator, written for this project.

An agent or a batch job sends such requests all day; suffix decoding drafts each answer from
the earlier answers (`drafter_worker.suffix`). Used by `specd bench serve --dataset-name
structured` and `benchmarks/suffix_workload.py`.
"""

from __future__ import annotations

import random

#: The request kinds, in the order `structured_requests` cycles through them.
KINDS: tuple[str, ...] = ("json", "sql", "function", "tool")

_NAMES = ["Alice", "Bob", "Carmen", "Deepak", "Elena", "Farid", "Grace", "Hiro", "Ines",
          "Jonas", "Kemi", "Luca", "Mei", "Nora", "Omar", "Priya"]
_CITIES = ["Paris", "Lagos", "Osaka", "Lima", "Oslo", "Pune", "Quito", "Rome", "Seoul",
           "Tunis", "Vienna", "Warsaw"]
_TABLES = [("orders", ["id", "customer_id", "total", "created_at"]),
           ("users", ["id", "name", "email", "country"]),
           ("products", ["id", "title", "price", "stock"]),
           ("payments", ["id", "order_id", "amount", "status"])]
_FUNCS = [("add", "the sum of a and b", "a, b"), ("is_even", "whether n is even", "n"),
          ("square", "n multiplied by itself", "n"), ("maximum", "the larger of a and b", "a, b"),
          ("reverse", "the string s reversed", "s"), ("count_vowels", "the number of vowels "
                                                                       "in s", "s")]
_TOOLS = [("get_weather", "city"), ("get_time", "city"), ("book_table", "city")]


#: `json_schema_requests`' kinds and their schemas (every field required, no others: the
#: strict-mode shape OpenAI documents).
SCHEMAS: dict[str, dict] = {
    "person": {"type": "object", "additionalProperties": False,
               "required": ["name", "age", "city"],
               "properties": {"name": {"type": "string", "maxLength": 40},
                              "age": {"type": "integer", "minimum": 0, "maximum": 150},
                              "city": {"type": "string", "maxLength": 40}}},
    "order": {"type": "object", "additionalProperties": False,
              "required": ["item", "quantity", "express"],
              "properties": {"item": {"type": "string", "maxLength": 40},
                             "quantity": {"type": "integer", "minimum": 1, "maximum": 1000},
                             "express": {"type": "boolean"}}},
    "event": {"type": "object", "additionalProperties": False,
              "required": ["title", "city", "month"],
              "properties": {"title": {"type": "string", "maxLength": 60},
                             "city": {"type": "string", "maxLength": 40},
                             "month": {"enum": ["January", "February", "March", "April", "May",
                                                "June", "July", "August", "September",
                                                "October", "November", "December"]}}},
}
_ITEMS = ["lamp", "chair", "kettle", "notebook", "bicycle", "umbrella", "teapot", "backpack"]
_EVENTS = ["jazz festival", "book fair", "marathon", "film week", "food market",
           "chess open"]
_MONTHS = SCHEMAS["event"]["properties"]["month"]["enum"]


def json_schema_requests(n: int, seed: int = 0) -> list[tuple[str, str, dict]]:
    """``n`` ``(kind, prompt, schema)`` extraction requests cycling through `SCHEMAS`' kinds
    (person, order, event), fields drawn with ``seed``: the answer is constrained to
    ``schema`` (`specd bench serve --dataset-name json-schema`)."""
    rng = random.Random(seed)
    kinds = list(SCHEMAS)
    out = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        if kind == "person":
            text = (f"Extract the person from this sentence as JSON.\nSentence: "
                    f"{rng.choice(_NAMES)} is {rng.randint(18, 80)} years old and lives in "
                    f"{rng.choice(_CITIES)}.")
        elif kind == "order":
            text = (f"Extract the order as JSON.\nMessage: please send me "
                    f"{rng.randint(1, 12)} x {rng.choice(_ITEMS)}"
                    f"{', express delivery' if rng.random() < 0.5 else ''}. Thanks, "
                    f"{rng.choice(_NAMES)}")
        else:
            text = (f"Extract the event as JSON.\nNotice: the {rng.choice(_EVENTS)} comes to "
                    f"{rng.choice(_CITIES)} in {rng.choice(_MONTHS)}.")
        out.append((kind, text, SCHEMAS[kind]))
    return out


def structured_requests(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` ``(kind, prompt)`` pairs cycling through four kinds of repeated-structure
    request (json, sql, function, tool), fields drawn with ``seed``."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        if kind == "json":
            name, city, age = rng.choice(_NAMES), rng.choice(_CITIES), rng.randint(18, 80)
            text = (f"Extract the person's name, age and city from this sentence. Answer "
                    f"with JSON only, keys \"name\", \"age\", \"city\".\nSentence: {name} is "
                    f"{age} years old and lives in {city}.")
        elif kind == "sql":
            table, cols = rng.choice(_TABLES)
            col = rng.choice(cols[1:])
            text = (f"Write one SQL query that returns the {col} of every row of the table "
                    f"{table} whose id is greater than {rng.randint(1, 500)}, ordered by id. "
                    f"Answer with the SQL only.")
        elif kind == "function":
            fname, what, args = rng.choice(_FUNCS)
            text = (f"Write a Python function {fname}({args}) with a one-line docstring that "
                    f"returns {what}. Answer with the code only.")
        else:
            tool, arg = rng.choice(_TOOLS)
            text = (f"You can call the tool {tool}({arg}). The user asks about "
                    f"{rng.choice(_CITIES)}. Answer with the tool call as JSON only: "
                    f"{{\"name\": ..., \"arguments\": {{...}}}}.")
        out.append((kind, text))
    return out
