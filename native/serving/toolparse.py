"""The model's tool calls read from its answer, one parser per template family (tools.FAMILIES).

`parse(family, text, schemas)` reads the answer so far: the content before the first call, the calls (each
call's arguments text grows by appending only, so a stream can send the new part), the content after them.
`ToolStream` turns that into OpenAI's `delta.tool_calls`; a whole answer goes through the same stream, so a
streamed and a whole response agree."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Callable

from .reasoning import partial_suffix
from .tools import new_call_id

MARKERS = {"qwen-json": ("<tool_call>",), "qwen-xml": ("<tool_call>",), "mistral": ("[TOOL_CALLS]",),
           "mistral-args": ("[TOOL_CALLS]",), "llama3": ("<|python_tag|>", '{"name"')}
_OBJ_CALL = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_DECODER = json.JSONDecoder()


@dataclass
class Call:
    name: str | None  # None until the model has written it
    args: str = ""  # the arguments' JSON text so far; only ever grows
    done: bool = False


@dataclass
class Parsed:
    head: str  # content before the first call (the whole text where no call began)
    calls: list[Call] = field(default_factory=list)
    tail: str = ""  # content after the last finished call
    started: bool = False  # a call marker was seen


def value_end(text: str, pos: int) -> int | None:
    """Where the JSON value starting at `pos` (after whitespace) ends; None while it is incomplete (or is not
    JSON). json's C decoder does the scan: the answer is read again at every token."""
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    if pos >= len(text):
        return None
    try:
        _, end = _DECODER.raw_decode(text, pos)
    except ValueError:
        return None
    return end if text[pos] in "{[\"" or end < len(text) else None  # a number at the end may still grow


def _loads(s: str):
    try:
        return json.loads(s)
    except ValueError:
        return None


def json_call(text: str, pos: int) -> tuple[Call | None, int | None]:
    """A `{"name": ..., "arguments"|"parameters": {...}}` object at `pos`: the call so far and where the object
    ends (None while incomplete). Keys in another order are read once the object is complete."""
    m = _OBJ_CALL.match(text, pos)
    end = value_end(text, pos)
    if m is None:
        obj = _loads(text[pos:end]) if end is not None else None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None, end
        args = obj.get("arguments", obj.get("parameters", {}))
        return Call(obj["name"], args if isinstance(args, str) else json.dumps(args), True), end
    name = _loads(f'"{m.group(1)}"')
    a_end = value_end(text, m.end())
    args = text[m.end():a_end if a_end is not None else len(text)].strip()
    return Call(name, args, end is not None), end


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _qwen_json(text: str, pos: int, schemas: dict) -> tuple[list[Call], int | None]:
    body = _skip_ws(text, pos + len("<tool_call>"))
    call, end = json_call(text, body)
    if call is None or end is None:
        return ([call] if call else []), None
    close = text.find("</tool_call>", end)
    if close < 0:
        call.done = False
        return [call], None
    return [call], close + len("</tool_call>")


_FUNC = re.compile(r"\s*<function=([^>\n]*)>\s*")
_PARAM = re.compile(r"\s*<parameter=([^>\n]*)>\n?")
_FUNC_END = re.compile(r"\s*</function>\s*")


def xml_value(raw: str, schema: dict) -> str:
    """A `<parameter>` value as JSON: text stays a string where the schema says string (or the text is not
    JSON); numbers, booleans, objects and arrays are read as JSON."""
    raw = raw[:-1] if raw.endswith("\n") else raw
    if schema.get("type") != "string":
        v = _loads(raw)
        if v is not None or raw.strip() == "null":
            return json.dumps(v)
    return json.dumps(raw)


def _qwen_xml(text: str, pos: int, schemas: dict) -> tuple[list[Call], int | None]:
    m = _FUNC.match(text, pos + len("<tool_call>"))
    if m is None:
        return [], None
    name = m.group(1)
    props = (schemas.get(name) or {}).get("properties") or {}
    at, parts = m.end(), []
    while (p := _PARAM.match(text, at)) is not None:
        close = text.find("</parameter>", p.end())
        if close < 0:  # a string value streams as it comes (less what may be its closing tag)
            key, schema = p.group(1), props.get(p.group(1), {})
            if schema.get("type") == "string":
                raw = text[p.end():]
                raw = raw[:len(raw) - partial_suffix(raw, "\n</parameter>")]
                return [Call(name, "{" + ", ".join(parts + [f"{json.dumps(key)}: {json.dumps(raw)[:-1]}"]))], None
            break
        parts.append(f"{json.dumps(p.group(1))}: {xml_value(text[p.end():close], props.get(p.group(1), {}))}")
        at = close + len("</parameter>")
    call = Call(name, "{" + ", ".join(parts))
    fn_end = _FUNC_END.match(text, at)
    if fn_end is None:
        return [call], None
    call.args, call.done = call.args + "}", True
    close = text.startswith("</tool_call>", fn_end.end())
    return [call], fn_end.end() + (len("</tool_call>") if close else 0)


def _mistral(text: str, pos: int, schemas: dict) -> tuple[list[Call], int | None]:
    at = _skip_ws(text, pos + len("[TOOL_CALLS]"))
    if at >= len(text) or text[at] != "[":
        return [], None
    calls, at = [], at + 1
    while True:
        at = _skip_ws(text, at)
        call, end = json_call(text, at)
        if call is not None:
            calls.append(call)
        if end is None:
            return calls, None
        at = _skip_ws(text, end)
        if text.startswith("]", at):
            return calls, at + 1
        if not text.startswith(",", at):
            return calls, None if at >= len(text) else at
        at += 1


_ARGS_HEAD = re.compile(r"([^\[\]\s]+)(?:\[CALL_ID\][A-Za-z0-9]*)?\[ARGS\]")


def _mistral_args(text: str, pos: int, schemas: dict) -> tuple[list[Call], int | None]:
    m = _ARGS_HEAD.match(text, pos + len("[TOOL_CALLS]"))
    if m is None:
        return [], None
    end = value_end(text, m.end())
    args = text[m.end():end if end is not None else len(text)].strip()
    return [Call(m.group(1), args, end is not None)], end


def _llama3(text: str, pos: int, schemas: dict) -> tuple[list[Call], int | None]:
    if text.startswith("<|python_tag|>", pos):
        pos = _skip_ws(text, pos + len("<|python_tag|>"))
    call, end = json_call(text, pos)
    if end is not None and text.startswith(";", _skip_ws(text, end)):
        end = _skip_ws(text, end) + 1  # Llama's calls may be separated by ';'
    return ([call] if call else []), end


_PARSERS: dict[str, Callable] = {"qwen-json": _qwen_json, "qwen-xml": _qwen_xml, "mistral": _mistral,
                                 "mistral-args": _mistral_args, "llama3": _llama3}


def _next_marker(family: str, text: str, at: int) -> int:
    if family == "llama3":  # a Llama call is the whole answer: it may only begin after whitespace
        start = _skip_ws(text, at)
        rest = text[start:]
        is_call = rest.startswith("<|python_tag|>") or re.match(r'\{\s*"name"\s*:', rest) is not None
        return start if is_call else -1
    found = [i for i in (text.find(m, at) for m in MARKERS[family]) if i >= 0]
    return min(found) if found else -1


def parse(family: str, text: str, schemas: dict) -> Parsed:
    """The answer so far: content, calls (the last may be unfinished), content after them."""
    start = _next_marker(family, text, 0)
    if start < 0:
        return Parsed(text)
    out = Parsed(text[:start], started=True)
    at = start
    while at >= 0:
        calls, end = _PARSERS[family](text, at, schemas)
        if not calls and end is not None:  # a finished marker with no call in it: content
            out.tail = text[at:]
            return out
        out.calls += calls
        if end is None:
            return out
        nxt = _next_marker(family, text, end)
        if nxt < 0 or text[end:nxt].strip():
            out.tail = text[end:]
            return out
        at = nxt
    return out


def partial_marker(family: str, text: str) -> int:
    """How many characters at the end of `text` may be the start of a call marker (held back from a stream)."""
    if family == "llama3":
        rest = text.lstrip()
        return len(rest) if any(m.startswith(rest) for m in MARKERS[family]) else 0
    longest = max(len(m) for m in MARKERS[family])
    for n in range(min(len(text), longest - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in MARKERS[family]):
            return n
    return 0


class ToolStream:
    """Answer text in, OpenAI deltas out: content until a call begins (holding back what may become a marker
    and trailing whitespace), then `tool_calls` deltas: index, id and name once the name is known, then the
    arguments as they grow; content after the calls at the end."""

    def __init__(self, family: str, schemas: dict, parallel: bool = True,
                 new_id: Callable[[], str] = new_call_id):
        self.family, self.schemas, self.parallel, self.new_id = family, schemas, parallel, new_id
        self.text = ""
        self.sent_content = 0  # characters of the head sent as content
        self.sent_args: list[int] = []  # per call sent: characters of its arguments sent
        self.parsed = Parsed("")

    @property
    def n_calls(self) -> int:
        return len(self.sent_args)

    @property
    def complete(self) -> bool:
        """Every call the answer began was finished."""
        return all(c.done for c in self.parsed.calls) and (not self.parsed.started or bool(self.parsed.calls))

    def feed(self, piece: str) -> list[dict]:
        self.text += piece
        return self._deltas(final=False)

    def flush(self) -> list[dict]:
        return self._deltas(final=True)

    def _deltas(self, final: bool) -> list[dict]:
        p = self.parsed = parse(self.family, self.text, self.schemas)
        if not p.started:
            upto = len(p.head) if final else len(p.head[:len(p.head) - partial_marker(self.family, p.head)].rstrip())
            return self._content(p.head, upto)
        out = self._content(p.head, len(p.head.rstrip()))
        calls = p.calls if self.parallel else p.calls[:1]
        for i, c in enumerate(calls):
            if c.name is None:
                break
            if i == len(self.sent_args):
                self.sent_args.append(0)
                out.append({"tool_calls": [{"index": i, "id": self.new_id(), "type": "function",
                                            "function": {"name": c.name, "arguments": ""}}]})
            if len(c.args) > self.sent_args[i]:
                out.append({"tool_calls": [{"index": i, "function": {"arguments": c.args[self.sent_args[i]:]}}]})
                self.sent_args[i] = len(c.args)
        if final and p.tail.strip():
            out.append({"content": ("\n\n" if self.sent_content else "") + p.tail.strip()})
        return out

    def _content(self, head: str, upto: int) -> list[dict]:
        if upto <= self.sent_content:
            return []
        piece, self.sent_content = head[self.sent_content:upto], upto
        return [{"content": piece}]
