"""Write benchmarks/prompts/agentic.jsonl: requests that resemble an agent's or an editor assistant's traffic, made
from a seed (issue 54's workload for the suffix drafter). Every request is a chat: one system prompt with the same
tool schemas, then

- tool loops: a user task, earlier assistant tool calls and the tool results fed back, the next call or answer due;
- JSON extraction: one schema, a different record's text each time;
- file edits: "apply this change to this file" on a generated Python file of 50-200 lines, the whole file back;
- re-asking: a question about code the conversation already showed.

Two halves: `warmup` and `measured`, which share nothing but the system prompt and the tool schemas (other cities,
people, files and names: each half draws from its own disjoint pools).

    python benchmarks/prompts/make_agentic.py [--seed 0] [--per-kind 6]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

OUT = Path(__file__).with_name("agentic.jsonl")

TOOLS = [
    {"name": "get_weather", "description": "Current weather for a city.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                    "required": ["city"]}},
    {"name": "search_files", "description": "Find files in the repository whose text matches a pattern.",
     "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}, "path": {"type": "string"}},
                    "required": ["pattern"]}},
    {"name": "read_file", "description": "Read a file of the repository.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
]
SYSTEM = ("You are a coding assistant with tools. To call a tool, answer with one JSON object "
          '{"tool": NAME, "arguments": {...}} and nothing else; otherwise answer the user.\nTools:\n'
          + "\n".join(json.dumps(t) for t in TOOLS))

# disjoint pools: the first half of each for warm-up, the second for the measured half
CITIES = ["Paris", "Lyon", "Oslo", "Bergen", "Madrid", "Seville", "Turin", "Milan", "Porto", "Lisbon", "Ghent",
          "Bruges", "Krakow", "Gdansk", "Dublin", "Cork", "Vienna", "Graz", "Zurich", "Basel", "Prague", "Brno",
          "Tallinn", "Riga"]
PEOPLE = ["Ada Byrne", "Li Wei", "Omar Haddad", "Sara Lind", "Jon Ek", "Mia Rossi", "Ravi Iyer", "Ana Sousa",
          "Tom Kerr", "Eva Novak", "Ken Sato", "Nia Adeyemi", "Leo Marchetti", "Ida Berg", "Max Vogel",
          "Zoe Clarke", "Raj Patel", "Uma Das", "Ben Cohen", "Aya Mori", "Noa Levi", "Eli Stone", "Kai Lund",
          "Liv Dahl"]
JOBS = ["nurse", "welder", "teacher", "pilot", "chef", "baker", "lawyer", "actor", "farmer", "coder", "miner",
        "sailor"]
NOUNS = ["order", "invoice", "ticket", "report", "account", "session", "parcel", "booking", "payment", "review",
         "record", "upload", "sensor", "device", "route", "batch"]
VERBS = ["load", "parse", "check", "merge", "render", "update", "fetch", "store", "count", "clean", "split",
         "score"]


def half(pool: list[str], which: str) -> list[str]:
    n = len(pool) // 2
    return pool[:n] if which == "warmup" else pool[n:]


def py_file(rng: random.Random, nouns: list[str], n_lines: int) -> tuple[str, list[str]]:
    """A Python module of about n_lines lines: small functions over records; returns it and its function names."""
    lines, names = ['"""Helpers for the records service."""', "", "import json", ""], []
    while len(lines) < n_lines:
        noun, verb = rng.choice(nouns), rng.choice(VERBS)
        name = f"{verb}_{noun}"
        if name in names:
            continue
        names.append(name)
        field = rng.choice(["id", "total", "status", "owner", "created", "items"])
        lines += [f"def {name}({noun}, limit=10):",
                  f'    """{verb.capitalize()} one {noun} by its {field}."""',
                  f"    if {noun} is None:",
                  f"        raise ValueError('no {noun}')",
                  f"    values = [x for x in {noun}.get('{field}', []) if x is not None]",
                  f"    if len(values) > limit:",
                  f"        values = values[:limit]",
                  f"    return {{'{field}': values, 'count': len(values)}}",
                  "", ""]
    return "\n".join(lines[:n_lines]) + "\n", names


def tool_loop(rng: random.Random, which: str) -> dict:
    city, city2 = rng.sample(half(CITIES, which), 2)
    task = f"Compare the weather in {city} and {city2} and tell me where to go for a walk."
    msgs = [{"role": "user", "content": task},
            {"role": "assistant", "content": json.dumps({"tool": "get_weather", "arguments": {"city": city}})},
            {"role": "user", "content": "Tool result: " + json.dumps(
                {"city": city, "temp_c": rng.randint(-5, 30), "sky": rng.choice(["clear", "rain", "cloudy"])})}]
    if rng.random() < 0.5:
        msgs += [{"role": "assistant", "content": json.dumps({"tool": "get_weather", "arguments": {"city": city2}})},
                 {"role": "user", "content": "Tool result: " + json.dumps(
                     {"city": city2, "temp_c": rng.randint(-5, 30), "sky": rng.choice(["clear", "rain"])})}]
    return {"kind": "tool_loop", "messages": msgs}


def extraction(rng: random.Random, which: str) -> dict:
    person, city, job = rng.choice(half(PEOPLE, which)), rng.choice(half(CITIES, which)), rng.choice(JOBS)
    age = rng.randint(19, 80)
    text = f"{person} ({age}) moved to {city} last spring and now works as a {job}."
    ask = ('Extract the person as JSON with the keys "name", "age", "city" and "job", and nothing else.\n\n'
           f"Text: {text}")
    return {"kind": "extraction", "messages": [{"role": "user", "content": ask}]}


def edit(rng: random.Random, which: str) -> dict:
    nouns = half(NOUNS, which)
    src, names = py_file(rng, nouns, rng.randint(50, 200))
    name = rng.choice(names)
    new = name.replace("_", "_all_", 1)
    ask = (f"Apply this change to this file: rename the function `{name}` to `{new}` (and nothing else). "
           f"Print the whole file back.\n\n```python\n{src}```")
    return {"kind": "edit", "messages": [{"role": "user", "content": ask}]}


def reask(rng: random.Random, which: str) -> dict:
    nouns = half(NOUNS, which)
    src, names = py_file(rng, nouns, rng.randint(30, 60))
    name = rng.choice(names)
    msgs = [{"role": "user", "content": "Call read_file on records.py."},
            {"role": "assistant", "content": json.dumps({"tool": "read_file", "arguments": {"path": "records.py"}})},
            {"role": "user", "content": f"Tool result:\n```python\n{src}```"},
            {"role": "assistant", "content": "I have read records.py."},
            {"role": "user", "content": f"Show me the function `{name}` again and explain its limit."}]
    return {"kind": "reask", "messages": msgs}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--per-kind", type=int, default=6, help="requests of each kind in each half")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    rows = []
    for which in ("warmup", "measured"):
        for i in range(a.per_kind):
            for make in (tool_loop, extraction, edit, reask):
                row = make(rng, which)
                row["messages"] = [{"role": "system", "content": SYSTEM}] + row["messages"]
                rows.append({"name": f"{which}-{row['kind']}-{i}", "half": which, **row})
    OUT.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(f"{len(rows)} requests -> {OUT}")


if __name__ == "__main__":
    main()
