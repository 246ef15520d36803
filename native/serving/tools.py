"""Tool calls on the request side: `tools`, `tool_choice`, `parallel_tool_calls` validated, the template's
tool-call family told from its text, and the conversation's tool calls and results made ready for the template.
Pure: no HTTP and no model (parsing the model's output is toolparse.py's; the forcing grammar toolgrammar.py's)."""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # OpenAI: letters, digits, underscores and dashes, at most 64
CHOICES = ("auto", "none", "required")

# The tool-call formats specq parses, told from the template's text: (family, needles all present, needles none
# of which may be). First match wins: Qwen3.5's and Qwen3-Coder's templates also name <tool_call>, so the XML
# form is looked for first; GLM's <arg_key>, MiniMax's <invoke> and Apriel's <tool_calls> lists are other formats.
FAMILIES = (
    ("qwen-xml", ("<tool_call>", "<function=", "<parameter="), ()),  # Qwen3-Coder, Qwen3.5/3.6
    ("qwen-json", ("<tool_call>",), ("arg_key", "<invoke", "<tool_calls>")),  # Qwen2.5/3, QwQ, Hermes, Granite 4
    ("mistral-args", ("[TOOL_CALLS]", "[ARGS]"), ()),  # Mistral Small 3.2, Devstral, Ministral 3: name[ARGS]{...}
    ("mistral", ("[TOOL_CALLS]",), ()),  # Mistral Nemo: [TOOL_CALLS][{"name", "arguments", "id"}]
    ("llama3", ("<|start_header_id|>", '"parameters"'), ()),  # Llama 3.1-3.3: {"name", "parameters"}
)
_READS_TOOLS = re.compile(r"\btools\b")


class ToolError(ValueError):
    """A tool field the server refuses; `param` names it (api.py turns it into a 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def template_family(template: str) -> str | None:
    """The tool-call family of a chat template, or None where it never reads `tools` or writes no format that
    specq parses (Gemma's, for one)."""
    if not _READS_TOOLS.search(template):
        return None
    for name, needles, other in FAMILIES:
        if all(n in template for n in needles) and not any(n in template for n in other):
            return name
    return None


@dataclass(frozen=True)
class ToolRequest:
    """What a request asked for tools: the tools as sent, the choice and whether several calls may come."""

    tools: tuple[dict, ...]
    choice: str  # "auto" | "none" | "required" | "function" (one named function)
    name: str | None = None  # the function tool_choice names
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Tools go to the template and the output is parsed (tool_choice none: neither)."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        """The output must be a call: a grammar constrains it."""
        return self.choice in ("required", "function")

    def schemas(self) -> dict[str, dict]:
        """Each function's parameter schema by name."""
        return {t["function"]["name"]: t["function"].get("parameters") or {"type": "object", "properties": {}}
                for t in self.tools}


def _tool(t: Any, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
        raise ToolError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}", "tools")
    fn = t["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ToolError(f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-' (got "
                        f"{json.dumps(name)})", "tools")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise ToolError(f"{where}.function.parameters must be a JSON schema object", "tools")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise ToolError(f"{where}.function.description must be a string", "tools")
    return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


def parse_tools(body: dict) -> ToolRequest | None:
    """`tools`, `tool_choice`, `parallel_tool_calls` → ToolRequest (None: no tools); ToolError naming the field."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None and not isinstance(tools, list):
        raise ToolError("'tools' must be a list of function tools", "tools")
    parsed = tuple(_tool(t, i) for i, t in enumerate(tools or []))
    names = [t["function"]["name"] for t in parsed]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ToolError(f"'tools' names the function {dup!r} twice", "tools")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError(f"'parallel_tool_calls' must be true or false (got {json.dumps(parallel)})",
                        "parallel_tool_calls")
    kind, name = _choice(choice, names)
    if not parsed:
        return None
    # a named tool_choice is a call to exactly that function (OpenAI): one call, whatever parallel_tool_calls says
    return ToolRequest(parsed, kind, name, parallel is not False and kind != "function")


def _choice(choice: Any, names: list[str]) -> tuple[str, str | None]:
    if choice is None:
        return ("auto" if names else "none"), None
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise ToolError(f"'tool_choice' must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", "
                            f"\"function\": {{\"name\": ...}}}} (got {json.dumps(choice)})", "tool_choice")
        if choice != "none" and not names:
            raise ToolError(f"'tool_choice' {choice!r} needs 'tools'", "tool_choice")
        return choice, None
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ToolError("'tool_choice' must name a function as {\"type\": \"function\", \"function\": "
                        f"{{\"name\": ...}}}} (got {json.dumps(choice)})", "tool_choice")
    if name not in names:
        raise ToolError(f"'tool_choice' names the function {name!r}, which is not in 'tools' "
                        f"({', '.join(names) or 'none given'})", "tool_choice")
    return "function", name


# ==== the conversation ============================================================================
def message_tool_calls(calls: Any, i: int) -> list[dict]:
    """An assistant message's `tool_calls` for the template: arguments as objects (templates iterate them or
    write them with tojson), ids kept."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise ToolError(f"{where} must be a list", "messages")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolError(f"{where}[{j}] must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                            "\"arguments\"}}}}", "messages")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as e:
                raise ToolError(f"{where}[{j}].function.arguments is not valid JSON ({e})", "messages")
        if not isinstance(args, dict):
            raise ToolError(f"{where}[{j}].function.arguments must be a JSON object", "messages")
        call_id = c.get("id")
        out.append({"id": call_id if isinstance(call_id, str) else f"call_{j}", "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def short_id(call_id: str) -> str:
    """Mistral's templates take only 9-character alphanumeric call ids: others map to a stable one."""
    if len(call_id) == 9 and call_id.isalnum():
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def for_family(messages: list[dict], family: str | None) -> list[dict]:
    """The conversation as the family's template wants it (Mistral: 9-character call ids on both sides)."""
    if family not in ("mistral", "mistral-args"):
        return messages
    out = []
    for m in messages:
        m = dict(m)
        if "tool_calls" in m:
            m["tool_calls"] = [{**c, "id": short_id(c["id"])} for c in m["tool_calls"]]
        if "tool_call_id" in m:
            m["tool_call_id"] = short_id(m["tool_call_id"])
        out.append(m)
    return out


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]
