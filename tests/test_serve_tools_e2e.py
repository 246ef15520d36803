"""Tools and reasoning through a real `specq serve` (a subprocess on a free loopback port) on the demo pair,
driven by the `openai` client: with Qwen3.5's template (`--template`: tools in the XML call format, thinking
opened in the prompt) and with SmolLM2's own (no tools)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from serve_proc import ServerProc  # noqa: E402

TEMPLATES = Path(__file__).parent / "data" / "templates"
TEMPLATE = TEMPLATES / "Qwen3.5-4B.jinja"
ARGS = ["--threads", "1", "--max-tokens", "64", "--draft-max", "4"]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
# a forced call's free string could run past max_tokens on a model this small: the city is one of a few
FORCED_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
                   "required": ["city"]}}}]
MODEL = "SmolLM2-135M-Instruct.F32"  # the demo target's stem
ASK = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]


def _server(tmp_path_factory, *extra: str) -> ServerProc:
    from specq.native.commands.demo import demo_pair

    target, draft = demo_pair()
    return ServerProc(["--target", str(target), "--draft", str(draft), *ARGS, *extra],
                      tmp_path_factory.mktemp("serve") / "serve.log")


@pytest.fixture(scope="module")
def qwen_server(tmp_path_factory):
    srv = _server(tmp_path_factory, "--template", str(TEMPLATE))
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def qwen25_server(tmp_path_factory):
    """Qwen2.5's template (JSON calls, no thinking): on it the demo model, let go on, writes its call again."""
    srv = _server(tmp_path_factory, "--template", str(TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja"),
                  "--max-tokens", "96")
    try:
        yield srv
    finally:
        srv.stop()


def client(srv: ServerProc):
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", timeout=120, max_retries=0)


def _merge_stream(stream) -> tuple[dict, str]:
    """A stream's deltas → (message fields, finish_reason)."""
    msg: dict = {"content": "", "reasoning_content": "", "tool_calls": []}
    finish = None
    for n, chunk in enumerate(stream):
        assert n < 10_000
        if not chunk.choices:
            continue
        d, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
        msg["content"] += d.content or ""
        msg["reasoning_content"] += (d.model_extra or {}).get("reasoning_content") or ""
        for tc in d.tool_calls or ():
            if tc.index == len(msg["tool_calls"]):
                msg["tool_calls"].append({"id": tc.id, "name": tc.function.name, "arguments": ""})
            msg["tool_calls"][tc.index]["arguments"] += tc.function.arguments or ""
    return msg, finish


def test_a_tools_request_is_answered_and_stream_and_whole_agree(qwen_server):
    c = client(qwen_server)
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=48,
              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    whole = c.chat.completions.create(**kw)
    choice = whole.choices[0]
    streamed, finish = _merge_stream(c.chat.completions.create(**kw, stream=True))
    assert finish == choice.finish_reason
    calls = [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
             for t in choice.message.tool_calls or ()]
    assert [{**t, "id": None} for t in streamed["tool_calls"]] == [{**t, "id": None} for t in calls]
    assert streamed["content"] == (choice.message.content or "")
    if calls:  # parsed: each call's arguments are JSON
        assert finish == "tool_calls" and all(isinstance(json.loads(t["arguments"]), dict) for t in calls)
    else:  # left as content
        assert choice.message.content and finish in ("stop", "length")
    assert whole.usage.model_extra["speculative"]["n_drafted"] > 0


def test_a_thinking_template_returns_the_reasoning_apart(qwen_server):
    """Qwen3.5's template opens <think> in the prompt: what the model writes first is its reasoning."""
    c = client(qwen_server)
    think = c.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=24)
    reasoning = think.choices[0].message.model_extra.get("reasoning_content")
    assert reasoning and "<think>" not in reasoning and "</think>" not in (think.choices[0].message.content or "")
    plain = c.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=24,
                                      extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert plain.choices[0].message.content and not plain.choices[0].message.model_extra.get("reasoning_content")
    streamed, _ = _merge_stream(c.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=24,
                                                          stream=True))
    assert streamed["reasoning_content"] == reasoning


def test_tool_results_are_taken_back_into_the_conversation(qwen_server):
    c = client(qwen_server)
    call = {"id": "call_0123456789abcdef01234567", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": call["id"], "content": "Sunny and 24 degrees"}]
    before = c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=4)
    after = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=4)
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the call and its result reached the prompt
    assert after.usage.prompt_tokens > before.usage.prompt_tokens + 10


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_round_trips(qwen_server, choice):
    """tool_choice required / named: the grammar holds the answer to a call, which parses (streamed too, with
    tokens drafted under the constraint); its result goes back and the model answers."""
    c = client(qwen_server)
    kw = dict(model=MODEL, messages=ASK, tools=FORCED_TOOLS, tool_choice=choice, parallel_tool_calls=False,
              temperature=0, max_tokens=64, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    first = c.chat.completions.create(**kw)
    [call] = first.choices[0].message.tool_calls  # one call (parallel_tool_calls false), then the end
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "London", "Tokyo")
    spec = first.usage.model_extra["speculative"]
    assert spec["constrained"] is True and spec["n_drafted_constrained"] > 0, spec
    streamed, finish = _merge_stream(c.chat.completions.create(**kw, stream=True))
    assert finish == "tool_calls" and [(t["name"], json.loads(t["arguments"])) for t in streamed["tool_calls"]] \
        == [(call.function.name, json.loads(call.function.arguments))]
    back = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "Sunny and 24 degrees"}]
    answer = c.chat.completions.create(model=MODEL, messages=back, tools=TOOLS, temperature=0, max_tokens=16,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens


def test_bad_tool_choices_are_400s_naming_the_field(qwen_server):
    c = client(qwen_server)
    for choice, extra in (({"type": "function", "function": {"name": "get_stock"}}, {}),
                          ("required", {"response_format": {"type": "json_object"}})):  # two constraints
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=4,
                                      **extra)
        assert e.value.body["param"] == "tool_choice", e.value.body


def test_tools_on_a_template_without_tool_support_are_a_400(tmp_path_factory):
    srv = _server(tmp_path_factory)  # SmolLM2's own template never reads `tools`
    try:
        with pytest.raises(openai.BadRequestError) as e:
            client(srv).chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=4)
        assert (e.value.body["param"], e.value.body["code"]) == ("tools", "unsupported_parameter")
        ok = client(srv).chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                                 max_tokens=4)
        assert ok.choices[0].message.content is not None
    finally:
        srv.stop()


def test_logprobs_of_a_read_answer_all_arrive_when_streamed(qwen_server):
    """The deltas of a thinking answer do not line up with the text chunks: each token's entry still comes."""
    c = client(qwen_server)
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=24, logprobs=True)
    whole = c.chat.completions.create(**kw)
    entries = [e for ch in c.chat.completions.create(**kw, stream=True) if ch.choices and ch.choices[0].logprobs
               for e in ch.choices[0].logprobs.content]
    assert [e.token for e in entries] == [e.token for e in whole.choices[0].logprobs.content]
    assert entries and len(entries) >= whole.usage.completion_tokens - 1  # an end of generation has none


def test_a_response_format_holds_the_answer_after_the_reasoning_not_the_reasoning(qwen_server):
    """With the thinking opened by the prompt, a JSON schema applies after `</think>`: the reasoning is the
    model's own (greedy: the same as without the schema), not JSON; the answer never began within the limit, so
    it ends with `length`, never presented as complete."""
    c = client(qwen_server)
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    free = c.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=24)
    held = c.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=24,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}})
    reasoning = held.choices[0].message.model_extra.get("reasoning_content")
    assert reasoning and not reasoning.lstrip().startswith("{")
    assert reasoning == free.choices[0].message.model_extra.get("reasoning_content")
    assert held.choices[0].finish_reason == "length" and not held.choices[0].message.content


NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _args(text: str):
    """A call's arguments as JSON, or as the text where max_tokens cut them."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _calls(srv: ServerProc, stream: bool = False, **kw) -> tuple[list[tuple[str, dict]], str, list[int], dict]:
    """A greedy request's (calls as (name, arguments), finish_reason, the streamed tool-call indexes, usage's
    speculative counts)."""
    c = client(srv)
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=96) | kw
    if not stream:
        r = c.chat.completions.create(**kw)
        calls = [(t.function.name, _args(t.function.arguments)) for t in r.choices[0].message.tool_calls or ()]
        return calls, r.choices[0].finish_reason, [], r.usage.model_extra["speculative"]
    indexes, chunks = [], []
    for n, chunk in enumerate(c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})):
        assert n < 10_000
        chunks.append(chunk)
        indexes += [tc.index for ch in chunk.choices for tc in ch.delta.tool_calls or ()]
    msg, finish = _merge_stream(iter(chunks))
    return ([(t["name"], _args(t["arguments"])) for t in msg["tool_calls"]], finish, indexes,
            chunks[-1].usage.model_extra["speculative"])


def test_a_named_tool_choice_is_one_call_where_the_model_would_repeat_it(qwen25_server):
    """OpenAI's contract: tool_choice naming a function is exactly one call of it. On this template the demo model
    writes the call again and again when the grammar lets it (`required`, parallel calls allowed: the control);
    named, the grammar ends the answer after one call, whole and streamed (index 0 only), with drafting."""
    calls, finish, _, _ = _calls(qwen25_server, tool_choice="required")
    assert len(calls) >= 2 and calls[0][0] == "get_weather", calls  # the model repeats the call
    for parallel in (None, True, False):
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        calls, finish, _, spec = _calls(qwen25_server, tool_choice=NAMED, **extra)
        assert calls == [("get_weather", {"city": "Paris"})] and finish == "tool_calls", (parallel, calls)
        assert spec["constrained"] is True and spec["n_accepted_constrained"] > 0, spec
        streamed, finish, indexes, _ = _calls(qwen25_server, stream=True, tool_choice=NAMED, **extra)
        assert streamed == calls and finish == "tool_calls" and set(indexes) == {0}, (parallel, indexes)
    calls, finish, _, _ = _calls(qwen25_server, tool_choice="required", parallel_tool_calls=False)
    assert calls == [("get_weather", {"city": "Paris"})] and finish == "tool_calls"


def _gbnf_call(city: str) -> str:
    return json.dumps(f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>')


def test_auto_with_parallel_tool_calls_false_returns_one_call_of_several_written(qwen25_server):
    """Under tool_choice auto the model writes what it writes: here a grammar (llama-server's `grammar` field)
    makes it write two calls. With parallel_tool_calls true both come back; false, only the first, streamed as
    index 0 only."""
    grammar = f'root ::= {_gbnf_call("Paris")} "\\n" {_gbnf_call("London")}'
    both = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "London"})]
    for stream in (False, True):
        calls, finish, indexes, _ = _calls(qwen25_server, stream, extra_body={"grammar": grammar})
        assert calls == both and finish == "tool_calls"
        assert not stream or set(indexes) == {0, 1}
        calls, finish, indexes, _ = _calls(qwen25_server, stream, parallel_tool_calls=False,
                                           extra_body={"grammar": grammar})
        assert calls == both[:1] and finish == "tool_calls"
        assert not stream or set(indexes) == {0}
