"""`specq serve`'s OpenAI wire format as pure functions: request bodies → validated requests, results →
response bodies and stream chunks, and OpenAI-shaped errors. No HTTP and no model here."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ...version import __version__
from ...errors import SpecqError, UsageError, check_text
from ..core.constraint import Constraint
from ..core.settings import ACCEPT_MODES, DRAFT_MAX_CAP, GenerationSettings
from ..core.stats import GenerationStats
from ..drafters.registry import parse_drafter
from .logprob_wire import parse_logprobs, wire
from .tools import ToolError, ToolRequest, message_tool_calls, parse_tools

MAX_STOPS = 16  # OpenAI allows 4; llama-server takes any number. A bound keeps the per-token scan cheap.
# Fields OpenAI defines that this server cannot honour: refused, never silently ignored.
UNSUPPORTED = {
    "n": "only one choice per request (n = 1)",
    "best_of": "only one choice per request (best_of = 1)",
    "functions": "function calls are not supported",
    "function_call": "function calls are not supported",
    "logit_bias": "logit_bias is not supported",
    "frequency_penalty": "penalties are not supported (they would change the target's distribution)",
    "presence_penalty": "penalties are not supported (they would change the target's distribution)",
    "echo": "echo is not supported",
    "suffix": "suffix (insertion) is not supported",
}
# Values of those fields that ask for nothing beyond the default (null always does), so clients sending defaults work.
_HARMLESS = {"n": (1,), "best_of": (1,), "functions": ([],), "function_call": ("none",),
             "logit_bias": ({},), "frequency_penalty": (0,),
             "presence_penalty": (0,), "echo": (False,), "suffix": ("",)}


class ApiError(SpecqError):
    """A request the server refuses: an HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, code: str, type_: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.type, self.param = status, message, code, type_, param
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code, param=param)


def _text(text: str, what: str, param: str) -> str:
    """Request text the tokenizer will encode: a lone surrogate (valid JSON, "\\udcff") is a 400 naming the field."""
    try:
        return check_text(text, what)
    except UsageError as e:
        raise bad(str(e), param)


@dataclass(frozen=True)
class Limits:
    """What the server allows, from its flags."""

    max_tokens: int
    model_id: str
    draft: bool  # the server has a draft model (drafter "model" needs one)
    mtp: bool = False  # the server loaded the target's MTP head (drafter "mtp" needs it)


@dataclass(frozen=True)
class ApiRequest:
    kind: str  # "chat" | "completion"
    messages: tuple[dict, ...] | None
    prompt: str | None
    max_tokens: int
    stream: bool
    include_usage: bool
    stops: tuple[str, ...]
    overrides: dict  # GenerationSettings fields the request set (temp, top_k, …, seed, draft_max, p_min, accept)
    cache_prompt: bool = True  # reuse the cached prefix of the previous request (llama-server's field)
    speculative: bool = True  # False: draft_max 0, the target alone
    tools: ToolRequest | None = None  # chat: the tools, tool_choice and parallel_tool_calls asked for
    template_kwargs: dict | None = None  # chat_template_kwargs: extra variables for the chat template
    constraint: Constraint | None = None  # response_format / grammar, not yet compiled (app.py compiles it)


# ==== parsing ======================================================================================
def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e}); send a JSON object", "invalid_json")
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object (got {type(body).__name__})", "invalid_json")
    return body


def _number(body: dict, name: str, lo: float, hi: float, integer: bool = False, lo_open: bool = False):
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
        raise bad(f"'{name}' must be {'an integer' if integer else 'a number'} (got {json.dumps(v)})", name,
                  "invalid_type")
    if v < lo or v > hi or (lo_open and v == lo):
        raise bad(f"'{name}' must be {'>' if lo_open else '>='} {lo} and <= {hi} (got {v})", name)
    return v


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be true or false (got {json.dumps(v)})", name, "invalid_type")
    return v


def refuse_unsupported(body: dict) -> None:
    for name, why in UNSUPPORTED.items():
        if body.get(name) is not None and body[name] not in _HARMLESS.get(name, ()):
            raise ApiError(400, f"'{name}' is not supported by specq serve: {why}", "unsupported_parameter",
                           param=name)


def check_model(body: dict, limits: Limits) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise bad(f"'model' must be a string (got {json.dumps(model)})", "model", "invalid_type")
    if model != limits.model_id:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves '{limits.model_id}' "
                            "(see GET /v1/models)", "model_not_found", param="model")


def parse_stops(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad(f"'stop' must be a string or a list of strings (got {json.dumps(v)})", "stop", "invalid_type")
    if len(stops) > MAX_STOPS:
        raise bad(f"'stop' takes at most {MAX_STOPS} strings (got {len(stops)})", "stop")
    return tuple(_text(s, f"'stop' string {i}", "stop") for i, s in enumerate(stops) if s)


def parse_max_tokens(body: dict, limits: Limits) -> int:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    v = _number(body, name, -2**63, 2**63, integer=True)
    if v is None:
        return limits.max_tokens
    if v < 1:
        raise bad(f"'{name}' must be at least 1 (got {v})", name)
    if v > limits.max_tokens:
        raise bad(f"'{name}' exceeds this server's limit ({v} > {limits.max_tokens}); ask for fewer tokens "
                  "or start the server with a larger --max-tokens", name)
    return v


def parse_sampling(body: dict, limits: Limits) -> dict:
    """The GenerationSettings fields a request sets, OpenAI's names → specq's."""
    out: dict[str, Any] = {}
    for name, field_, lo, hi, integer, lo_open in (
            ("temperature", "temp", 0.0, 2.0, False, False), ("top_p", "top_p", 0.0, 1.0, False, True),
            ("top_k", "top_k", 0, 2**31 - 1, True, False), ("min_p", "min_p", 0.0, 1.0, False, False),
            ("seed", "seed", -2**63, 2**63 - 1, True, False), ("p_min", "p_min", 0.0, 1.0, False, False)):
        v = _number(body, name, lo, hi, integer, lo_open)
        if v is not None:
            out[field_] = v
    if "seed" in out:
        out["seed"] &= 0xFFFFFFFF  # llama.cpp's seed is 32 bits; negative seeds wrap as in C
    dm = body.get("draft_max")
    if dm is not None and not _target_alone(body):
        if dm != "auto" and (isinstance(dm, bool) or not isinstance(dm, int) or not 1 <= dm <= DRAFT_MAX_CAP):
            raise bad(f"'draft_max' must be an integer from 0 (the target alone) to {DRAFT_MAX_CAP} or \"auto\" "
                      f"(got {json.dumps(dm)})", "draft_max")
        out["draft_max"] = dm
    acc = body.get("accept")
    if acc is not None:
        if acc not in ACCEPT_MODES:
            raise bad(f"'accept' must be one of {', '.join(ACCEPT_MODES)} (got {json.dumps(acc)})", "accept")
        out["accept"] = acc
    drafter = body.get("drafter")
    if drafter is not None:
        out["drafter"] = parse_drafter_field(drafter, limits)
    return out


def _target_alone(body: dict) -> bool:
    """`draft_max: 0`: this request runs on the target alone, as `specq bench`'s baseline does."""
    dm = body.get("draft_max")
    return dm == 0 and isinstance(dm, int) and not isinstance(dm, bool)


def parse_drafter_field(drafter: Any, limits: Limits) -> str:
    """`drafter`: model, ngram, suffix, mtp, a comma list or auto; "model" only where the server loaded a draft model,
    "mtp" only where it loaded the target's MTP head."""
    try:
        names = parse_drafter(drafter) if isinstance(drafter, str) else None
    except UsageError:
        names = None
    if names is None:
        raise bad(f"'drafter' must be \"model\", \"ngram\", \"mtp\", a comma list of them, or \"auto\" "
                  f"(got {json.dumps(drafter)})", "drafter")
    if "model" in names and not limits.draft:
        raise bad("'drafter' \"model\" needs a draft model and this server has none; use \"ngram\"", "drafter")
    if "mtp" in names and not limits.mtp:
        raise bad("'drafter' \"mtp\" needs the target's MTP head and this server did not load one (start it with "
                  "--drafter mtp or auto on a target that has one); use \"ngram\"", "drafter")
    return drafter


def parse_constraint(body: dict) -> Constraint | None:
    """`response_format` (text, json_object, json_schema with `strict`) or llama-server's `grammar` (GBNF)."""
    rf, grammar = body.get("response_format"), body.get("grammar")
    if grammar is not None and grammar != "":
        if not isinstance(grammar, str):
            raise bad(f"'grammar' must be a GBNF grammar as a string (got {json.dumps(grammar)[:80]})", "grammar",
                      "invalid_type")
        if rf is not None and rf != {"type": "text"}:
            raise bad("'grammar' and 'response_format' cannot both constrain one answer; send one", "grammar")
        return Constraint("gbnf", _text(grammar, "'grammar'", "grammar"))
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":  # llama-server also takes a schema here
        schema = rf.get("schema")
        return Constraint("json_object") if schema is None else Constraint("json_schema", _schema_text(schema))
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise bad("'response_format' json_schema needs {\"json_schema\": {\"name\": …, \"schema\": {…}}}",
                      "response_format", "invalid_type")
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad(f"'response_format' json_schema.strict must be true or false (got {json.dumps(strict)})",
                      "response_format", "invalid_type")
        # strict: every keyword enforced (one the library cannot enforce is a 400); otherwise those are ignored
        return Constraint("json_schema", _schema_text(js["schema"]), lenient=not strict)
    raise bad(f"'response_format' type must be text, json_object or json_schema (got {json.dumps(kind)})",
              "response_format")


def _schema_text(schema: Any) -> str:
    if not isinstance(schema, (dict, bool)):
        raise bad(f"'response_format' schema must be a JSON object (got {json.dumps(schema)[:80]})",
                  "response_format", "invalid_type")
    return json.dumps(schema)


def constraint_param(c: Constraint) -> str:
    """The request field a constraint came from (a 400 names it)."""
    return "grammar" if c.kind == "gbnf" else "response_format"


def parse_content(content: Any, i: int) -> str:
    """A message's content: a string, null, or a list of text parts (images are refused)."""
    if content is None or isinstance(content, str):
        return _text(content or "", f"messages[{i}].content", "messages")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(f"messages[{i}].content: only text parts are supported (got {kind})", "messages")
            texts.append(_text(part["text"], f"messages[{i}].content", "messages"))
        return "".join(texts)
    raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages", "invalid_type")


def parse_message(m: Any, i: int) -> dict:
    """One message for the template: role and content, an assistant's `tool_calls` (content may then be null)
    and `reasoning_content`, a tool result's `tool_call_id` and `name`. Keys are set only where given
    (templates test `'tool_calls' in message`)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise bad(f"messages[{i}] must be an object with a string 'role'", "messages", "invalid_type")
    out = {"role": _text(m["role"], f"messages[{i}].role", "messages"), "content": parse_content(m.get("content"), i)}
    try:
        if m.get("tool_calls") and out["role"] == "assistant":
            out["tool_calls"] = message_tool_calls(m["tool_calls"], i)
    except ToolError as e:
        raise bad(str(e), e.param)
    for key in ("tool_call_id", "name", "reasoning_content"):
        v = m.get(key)
        if v is not None:
            if not isinstance(v, str):
                raise bad(f"messages[{i}].{key} must be a string (got {json.dumps(v)})", "messages", "invalid_type")
            out[key] = _text(v, f"messages[{i}].{key}", "messages")
    return out


def parse_messages(body: dict) -> tuple[dict, ...]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list of {\"role\", \"content\"} objects", "messages",
                  "invalid_type" if msgs is not None else "missing_required_parameter")
    return tuple(parse_message(m, i) for i, m in enumerate(msgs))


_TEMPLATE_NAMES = {"messages", "tools", "tool_choice", "functions", "function_call", "bos_token", "eos_token",
                   "add_generation_prompt", "raise_exception", "strftime_now"}  # set by the server


def parse_chat_fields(body: dict) -> tuple[ToolRequest | None, dict | None]:
    """`tools`/`tool_choice`/`parallel_tool_calls` and `chat_template_kwargs` of a chat request."""
    try:
        tools = parse_tools(body)
    except ToolError as e:
        raise bad(str(e), e.param)
    kw = body.get("chat_template_kwargs")
    if kw is None:
        return tools, None
    if not isinstance(kw, dict):
        raise bad("'chat_template_kwargs' must be an object (e.g. {\"enable_thinking\": false})",
                  "chat_template_kwargs", "invalid_type")
    for k in kw:
        if not k.isidentifier() or k in _TEMPLATE_NAMES:
            raise bad(f"'chat_template_kwargs' cannot set {k!r} (the server sets it, or it is not a name)",
                      "chat_template_kwargs")
    return tools, dict(kw)


# chat fields: refused on /v1/completions unless they ask for nothing
_CHAT_ONLY = {"tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (True, False),
              "chat_template_kwargs": ({},)}


def parse_prompt(body: dict) -> str:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if not isinstance(p, str):
        raise bad("'prompt' must be a string (one prompt per request; token arrays are not supported)", "prompt",
                  "invalid_type" if p is not None else "missing_required_parameter")
    return _text(p, "'prompt'", "prompt")


def parse_request(body: dict, kind: str, limits: Limits) -> ApiRequest:
    """A chat or completion request body → ApiRequest; ApiError naming the first bad field."""
    check_model(body, limits)
    refuse_unsupported(body)
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", "stream_options", "invalid_type")
    include_usage = _bool(opts or {}, "include_usage")
    tools, template_kwargs = parse_chat_fields(body) if kind == "chat" else (None, None)
    for name in _CHAT_ONLY if kind == "completion" else ():
        if body.get(name) is not None and body[name] not in _CHAT_ONLY[name]:
            raise ApiError(400, f"'{name}' is a chat field; send it to /v1/chat/completions",
                           "unsupported_parameter", param=name)
    return ApiRequest(
        kind=kind, messages=parse_messages(body) if kind == "chat" else None,
        prompt=parse_prompt(body) if kind == "completion" else None, max_tokens=parse_max_tokens(body, limits),
        stream=stream, include_usage=include_usage, stops=parse_stops(body),
        overrides={**parse_sampling(body, limits), "logprobs": parse_logprobs(body, kind, bad)},
        cache_prompt=_bool(body, "cache_prompt", default=True), speculative=not _target_alone(body),
        constraint=parse_constraint(body), tools=tools, template_kwargs=template_kwargs)


def settings_for(req: ApiRequest, defaults: GenerationSettings, seed: int) -> GenerationSettings:
    """The server's settings with what the request set; `seed` where the request set none."""
    from dataclasses import replace

    s = replace(defaults, **{"n_predict": req.max_tokens, "seed": seed, **req.overrides})
    return replace(s, draft_min=min(s.draft_min, s.draft_cap))


# ==== responses ====================================================================================
FINISH = {"eog": "stop", "stop": "stop", "n_predict": "length", "ctx": "length", "length": "length",
          "tool_calls": "tool_calls"}


@dataclass(frozen=True)
class Outcome:
    """What the scheduler reports when a generation ends."""

    finish: str  # an engine stop reason or "stop" (a stop string)
    n_prompt: int
    n_reused: int  # prompt tokens whose cache entries were kept from the previous request
    n_completion: int
    stats: GenerationStats | None
    # --parallel: how a step shared with other sequences was timed ("whole": each sequence's draft_ms and
    # verify_ms count the batched decodes whole, not a share); None: the step was its own
    shared_time: str | None = None


def usage(o: Outcome) -> dict:
    st = o.stats
    spec = None
    if st is not None and st.speculative:
        spec = {"n_drafted": st.n_drafted, "n_accepted": st.n_accepted, "accept_rate": st.accept_rate,
                "alpha": st.alpha,
                "draft_ms": round(st.draft_ms, 3), "verify_ms": round(st.verify_ms, 3),
                "tokens_per_s": round(st.tokens_per_s, 3)}
        if o.shared_time is not None:
            spec["shared_time"] = o.shared_time
        spec["constrained"] = st.constrained  # INTERFACES.md: a bool
        if st.vocab_map is not None:  # a draft of another vocabulary: its translation and overlap
            spec.update(vocab_map=st.vocab_map, vocab_overlap=round(st.vocab_overlap, 4))
        if st.n_drafted_store or st.n_drafted_text:  # --drafter suffix: from earlier answers, from this text
            spec.update(n_drafted_store=st.n_drafted_store, n_accepted_store=st.n_accepted_store,
                        n_drafted_text=st.n_drafted_text, n_accepted_text=st.n_accepted_text)
        if st.constrained:  # acceptance in the steps under the constraint, and what masking cost
            n = st.n_drafted_constrained
            spec.update(n_drafted_constrained=n, n_accepted_constrained=st.n_accepted_constrained,
                        accept_rate_constrained=st.n_accepted_constrained / n if n else None,
                        n_drafted_unforced=st.n_drafted_unforced, n_masks=st.n_masks,
                        n_masked_rows=st.n_masked_rows, mask_ms=round(st.mask_ms, 3))
    return {"prompt_tokens": o.n_prompt, "completion_tokens": o.n_completion,
            "total_tokens": o.n_prompt + o.n_completion, "prompt_tokens_details": {"cached_tokens": o.n_reused},
            "speculative": spec}


class ResponseIds:
    """The id, timestamp and model every chunk of one response repeats."""

    def __init__(self, kind: str, model: str):
        self.kind = kind
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = model

    def head(self, chunk: bool) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": f"specq-{__version__}"}


def full_response(ids: ResponseIds, text: str, o: Outcome, logprobs: list[dict] | None = None,
                  message: dict | None = None, finish: str | None = None) -> dict:
    """The whole answer; `message` (chat) replaces the plain one where the answer was read for reasoning and
    tool calls, `finish` the engine's reason (tool_calls)."""
    fr = FINISH.get(finish or o.finish, "stop")
    lp = None if logprobs is None else wire(ids.kind, logprobs)
    if ids.kind == "chat":
        msg = message if message is not None else {"role": "assistant", "content": text}
        choice = {"index": 0, "message": msg, "logprobs": lp, "finish_reason": fr}
    else:
        choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": fr}
    return {**ids.head(False), "choices": [choice], "usage": usage(o)}


def chunk(ids: ResponseIds, text: str | None, finish: str | None = None, first: bool = False,
          logprobs: list[dict] | None = None, offset: int = 0, delta: dict | None = None) -> dict:
    """One stream chunk: text (and the logprobs of the tokens it completes, `offset` the characters sent before;
    or a chat `delta`: reasoning_content, tool_calls), or (finish set) the closing chunk with an empty delta."""
    fr = FINISH.get(finish, "stop") if finish else None
    lp = None if logprobs is None else wire(ids.kind, logprobs, offset)
    if ids.kind == "chat":
        if delta is None:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text is not None else {})
        choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": fr}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": fr}
    return {**ids.head(True), "choices": [choice]}


def usage_chunk(ids: ResponseIds, o: Outcome) -> dict:
    """stream_options.include_usage: a last chunk with no choices and the usage."""
    return {**ids.head(True), "choices": [], "usage": usage(o)}


def sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
