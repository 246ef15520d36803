"""A chat answer's text → OpenAI's message parts: `reasoning_content` (a thinking model's thinking), `content`
and `tool_calls`. Streams and whole responses go through the same AnswerStream, so they agree."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ...errors import SpecqError
from .api import ApiError, ApiRequest
from .reasoning import ReasoningStream, ThinkFormat, opens_thinking
from ..core.template import TemplateFormatter
from .toolgrammar import GRAMMAR_MARKERS, forced_call_grammar, marker_tokens, tool_call_grammar
from .toolparse import ToolStream
from .tools import ToolRequest, for_family, new_call_id


@dataclass(frozen=True)
class AnswerPlan:
    """How one request's output is read."""

    family: str | None = None  # the tool-call parser (None: tool calls are not parsed)
    schemas: dict = field(default_factory=dict)  # each function's parameter schema (XML values are typed by it)
    parallel: bool = True
    think: ThinkFormat | None = None  # the thinking markers (None: no reasoning split)
    in_thinking: bool = False  # the prompt left the model inside its thinking
    forced: ToolRequest | None = None  # tool_choice required or a named function: a grammar holds the answer

    @property
    def plain(self) -> bool:
        return self.family is None and self.think is None


class AnswerStream:
    """Text pieces in, delta objects out ({"reasoning_content"}, {"content"}, {"tool_calls": [...]})."""

    def __init__(self, plan: AnswerPlan, new_id: Callable[[], str] = new_call_id):
        self.plan = plan
        self.reasoning = ReasoningStream(plan.think, plan.in_thinking) if plan.think else None
        self.tools = ToolStream(plan.family, plan.schemas, plan.parallel, new_id) if plan.family else None

    def feed(self, piece: str) -> list[dict]:
        return self._step(piece, final=False)

    def flush(self) -> list[dict]:
        return self._step("", final=True)

    def _step(self, piece: str, final: bool) -> list[dict]:
        out: list[dict] = []
        if self.reasoning is not None:
            thought, piece = self.reasoning.feed(piece, final)
            if thought:
                out.append({"reasoning_content": thought})
        if self.tools is not None:
            if final:
                self.tools.text += piece
                out += self.tools.flush()
            else:
                out += self.tools.feed(piece)
        elif piece:
            out.append({"content": piece})
        return out

    @property
    def n_calls(self) -> int:
        return self.tools.n_calls if self.tools is not None else 0

    def finish_reason(self, base: str) -> str:
        """`tool_calls` where the answer ended on finished calls; a cut answer stays `length`."""
        if self.n_calls and base == "stop" and self.tools.complete:
            return "tool_calls"
        return base


def merge(deltas: list[dict]) -> dict:
    """Deltas → the message's fields (content null where calls came without text)."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: list[dict] = []
    for d in deltas:
        content.append(d.get("content") or "")
        reasoning.append(d.get("reasoning_content") or "")
        for tc in d.get("tool_calls", ()):
            if tc["index"] == len(calls):
                calls.append({"id": tc["id"], "type": "function",
                              "function": {"name": tc["function"]["name"], "arguments": ""}})
            calls[tc["index"]]["function"]["arguments"] += tc["function"].get("arguments", "")
    msg: dict = {"role": "assistant", "content": "".join(content) or (None if calls else "")}
    if any(reasoning):
        msg["reasoning_content"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg


def render_chat(formatter: TemplateFormatter, family: str | None, think: ThinkFormat | None,
                req: ApiRequest) -> tuple[str, AnswerPlan]:
    """The conversation through the template, with the tools where the request's tool_choice lets the model
    call them, and how the answer will be read (its reasoning, the template's tool-call format)."""
    tr = req.tools if req.tools is not None and req.tools.active else None
    if tr is not None and family is None:
        raise ApiError(400, "'tools' needs a chat template that writes tool calls in a format specq reads (Qwen "
                            "<tool_call>, Llama 3 JSON, Mistral [TOOL_CALLS]) and this model's template has none; "
                            "send no tools, or start the server with --template FILE", "unsupported_parameter",
                       param="tools")
    try:
        text = formatter.render(for_family(list(req.messages), family), list(tr.tools) if tr else None,
                                req.template_kwargs)
    except SpecqError as e:
        raise ApiError(400, str(e), "invalid_messages", param="messages")
    if think is not None and text.rstrip().endswith(think.end):
        think = None  # the prompt closed the thinking (enable_thinking false): the model answers at once
    return text, AnswerPlan(family=family if tr else None, schemas=tr.schemas() if tr else {},
                            parallel=tr.parallel if tr else True, think=think,
                            in_thinking=think is not None and opens_thinking(text, think),
                            forced=tr if tr is not None and tr.forced else None)


def call_grammar(plan: AnswerPlan, tokenize: Callable[[str, bool], list[int]]) -> tuple[str, str | None]:
    """A forced call's grammar (Lark) and the marker after which it applies (None: from the first token):
    where the prompt opened the thinking, the grammar waits for its end; where the model may think first, the
    grammar lets it. `tokenize(text, parse_special)` is the target's: markers it holds as one special token
    are asked for as that token."""
    tr = plan.forced
    think = plan.think
    markers = GRAMMAR_MARKERS[plan.family] + ((think.start, think.end) if think else ())
    specials = marker_tokens(markers, tokenize)
    if think is not None and plan.in_thinking:
        return tool_call_grammar(plan.family, tr.tools, tr.name, tr.parallel, specials), think.end
    return forced_call_grammar(plan.family, tr.tools, tr.name, tr.parallel, think, False, specials), None
