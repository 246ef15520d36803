"""The grammar that forces a tool call (`tool_choice` "required" or a named function): llguidance's Lark text,
one call format per template family, each function's arguments constrained by its JSON schema (`%json`).
Pure text; the grammar engine compiles it. On a thinking model it applies to the answer, after the reasoning's
end marker (reasoning.ThinkFormat.end)."""

from __future__ import annotations

import json
import re
from typing import Callable, Iterable, Mapping, Sequence

from .reasoning import ThinkFormat

FAMILIES = ("qwen-json", "qwen-xml", "llama3", "mistral", "mistral-args")
# the markers each family's grammar writes (their token ids go in `specials` where the vocabulary has them)
GRAMMAR_MARKERS = {"qwen-json": ("<tool_call>", "</tool_call>"), "qwen-xml": ("<tool_call>", "</tool_call>"),
                   "llama3": (), "mistral": ("[TOOL_CALLS]",), "mistral-args": ("[TOOL_CALLS]", "[ARGS]")}
EMPTY_PARAMS = {"type": "object", "properties": {}}


def _lit(text: str, specials: Mapping[str, int]) -> str:
    """A marker as the model writes it: its special token where the vocabulary has one (`<[id]>`, as
    llguidance names a token by id), else the text."""
    return f"<[{specials[text]}]>" if text in specials else json.dumps(text)


def _params(tool: dict) -> dict:
    return tool["function"].get("parameters") or EMPTY_PARAMS


def _pick(tools: Sequence[dict], name: str | None) -> list[dict]:
    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    if not chosen:
        raise ValueError(f"no tool named {name!r} among {[t['function']['name'] for t in tools]}")
    return chosen


def _call_schema(tools: list[dict], args_key: str, extra: dict | None = None) -> dict:
    """One JSON object {"name": <one of the functions>, args_key: <that function's arguments>, extra...}."""
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                        args_key: _params(t), **(extra or {})},
                       "required": ["name", args_key], "additionalProperties": False} for t in tools]}


def _repeat(rule: str, parallel: bool, sep: str = '"\\n"') -> str:
    return f"start: {rule} ({sep} {rule})*\n" if parallel else f"start: {rule}\n"


def _qwen_json(tools: list[dict], parallel: bool, sp: Mapping[str, int]) -> str:
    return (_repeat("call", parallel)
            + f'call: {_lit("<tool_call>", sp)} "\\n" body "\\n" {_lit("</tool_call>", sp)}\n'
            + f"body: %json {json.dumps(_call_schema(tools, 'arguments'))}\n")


def _qwen_xml(tools: list[dict], parallel: bool, sp: Mapping[str, int]) -> str:
    """<tool_call>\\n<function=NAME>\\n<parameter=K>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>:
    string values are free text up to the closing tag, other values JSON of their schema."""
    lines = [_repeat("call", parallel),
             f'call: {_lit("<tool_call>", sp)} "\\n" fn "\\n" {_lit("</tool_call>", sp)}\n',
             "fn: " + " | ".join(f"fn_{i}" for i in range(len(tools))) + "\n"]
    for i, t in enumerate(tools):
        schema = _params(t)
        props, required = schema.get("properties") or {}, set(schema.get("required") or ())
        parts = []
        for j, (k, ps) in enumerate(props.items()):
            rule = f"p_{i}_{j}"
            parts.append(rule if k in required else f"{rule}?")
            head = f'{rule}: {json.dumps(f"<parameter={k}>")} "\\n" '
            if ps.get("type") == "string" and ps.get("enum"):  # one of the values, as text
                values = " | ".join(json.dumps(str(v)) for v in ps["enum"])
                lines.append(f'{head}v_{i}_{j} "\\n</parameter>\\n"\nv_{i}_{j}: {values}\n')
            elif ps.get("type") == "string" or not ps:  # text up to the first closing tag (lazy)
                lines.append(f'{head}v_{i}_{j} "\\n"\nv_{i}_{j}[lazy]: /(?s:.*)\\n<\\/parameter>/\n')
            else:
                lines.append(f'{head}j_{i}_{j} "\\n</parameter>\\n"\nj_{i}_{j}: %json {json.dumps(ps)}\n')
        head = json.dumps(f"<function={t['function']['name']}>")
        lines.append(f'fn_{i}: {head} "\\n" {" ".join(parts)} "</function>"\n')
    return "".join(lines)


def _llama3(tools: list[dict], parallel: bool, sp: Mapping[str, int]) -> str:
    # Llama 3.x templates take one call per message
    return f"start: %json {json.dumps(_call_schema(tools, 'parameters'))}\n"


def _mistral(tools: list[dict], parallel: bool, sp: Mapping[str, int]) -> str:
    # Nemo may write each call's 9-character id after its arguments
    call_id = {"id": {"type": "string", "pattern": "^[A-Za-z0-9]{9}$"}}
    array = {"type": "array", "items": _call_schema(tools, "arguments", call_id), "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    return f'start: {_lit("[TOOL_CALLS]", sp)} calls\ncalls: %json {json.dumps(array)}\n'


def _mistral_args(tools: list[dict], parallel: bool, sp: Mapping[str, int]) -> str:
    lines = [_repeat("call", parallel, sep=""),
             f'call: {_lit("[TOOL_CALLS]", sp)} (' + " | ".join(f"fn_{i}" for i in range(len(tools))) + ")\n"]
    for i, t in enumerate(tools):
        lines.append(f'fn_{i}: {json.dumps(t["function"]["name"])} {_lit("[ARGS]", sp)} args_{i}\n')
        lines.append(f"args_{i}: %json {json.dumps(_params(t))}\n")
    return "".join(lines)


_BUILDERS = {"qwen-json": _qwen_json, "qwen-xml": _qwen_xml, "llama3": _llama3, "mistral": _mistral,
             "mistral-args": _mistral_args}


def tool_call_grammar(family: str, tools: Sequence[dict], name: str | None = None, parallel: bool = True,
                      specials: Mapping[str, int] | None = None) -> str:
    """Lark text accepting one call (several where `parallel`) of `tools` (OpenAI tool objects; only the
    function `name` where given) in `family`'s format (tools.template_family), and nothing else.

    `specials`: the call markers (`<tool_call>`, `</tool_call>`, `[TOOL_CALLS]`, `[ARGS]`) that the model's
    vocabulary holds as special tokens, by token id: the grammar then asks for that token, as the model
    writes it, rather than the marker's text spelled in ordinary tokens."""
    if family not in _BUILDERS:
        raise ValueError(f"no tool-call grammar for the family {family!r} (known: {', '.join(FAMILIES)})")
    return _BUILDERS[family](_pick(tools, name), parallel, specials or {})


def with_thinking(grammar: str, think: ThinkFormat, in_thinking: bool,
                  specials: Mapping[str, int] | None = None) -> str:
    """`grammar` (Lark with a `start` rule) applied to the answer after a thinking model's reasoning: the
    reasoning is free text up to `think.end`; where the prompt did not leave the model inside it
    (`in_thinking` False), the reasoning is optional and begins with `think.start`."""
    sp = specials or {}
    answer = re.sub(r"^start:", "answer:", grammar, count=1, flags=re.M)
    if think.end in sp:
        reasoning = f"thought {_lit(think.end, sp)}\nthought: <[^{sp[think.end]}]>*\n"  # any token but the end
    else:  # lazy: the reasoning ends at the first end marker
        reasoning = "thought\nthought[lazy]: /(?s:.*)" + re.escape(think.end).replace("/", "\\/") + "/\n"
    head = "reasoning /[ \\t\\r\\n]*/"
    start = (f"start: {head} answer\n" if in_thinking
             else f"start: ({_lit(think.start, sp)} {head})? answer\n")
    return start + f"reasoning: {reasoning}" + answer


def marker_tokens(markers: Iterable[str], tokenize: Callable[[str, bool], list[int]]) -> dict[str, int]:
    """The markers the model's vocabulary holds as one special token, by id: `tokenize(text, parse_special)`
    gives one token with special tokens parsed and something else without (for `specials` above)."""
    out = {}
    for m in markers:
        ids = tokenize(m, True)
        if len(ids) == 1 and tokenize(m, False) != ids:
            out[m] = ids[0]
    return out


def forced_call_grammar(family: str, tools: Sequence[dict], name: str | None, parallel: bool,
                        think: ThinkFormat | None = None, in_thinking: bool = False,
                        specials: Mapping[str, int] | None = None) -> str:
    """The whole answer's grammar for `tool_choice` "required" (name None) or a named function: the call
    grammar, after the reasoning where the template thinks. `specials`: marker_tokens(GRAMMAR_MARKERS[family]
    + the thinking markers, the target's tokenize)."""
    grammar = tool_call_grammar(family, tools, name, parallel, specials)
    return with_thinking(grammar, think, in_thinking, specials) if think is not None else grammar
