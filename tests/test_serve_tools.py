"""Tool calls and reasoning in `specq serve`, in-process and pure: the real chat templates of each family
(tests/data/templates, from llama.cpp), the output parsers on canned model outputs (whole and streamed), the
rendering of tools and tool results, the reasoning split, the request checks, and the forcing grammar checked
by llguidance itself."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from specq.native.serving.answer import AnswerPlan, AnswerStream, call_grammar, merge, render_chat
from specq.native.serving.api import ApiError, Limits, parse_request
from specq.native.serving.reasoning import ThinkFormat, opens_thinking, split_reasoning, think_format
from specq.native.core.template import TemplateFormatter
from specq.native.serving.toolgrammar import forced_call_grammar, marker_tokens, tool_call_grammar, with_thinking
from specq.native.serving.tools import template_family

TEMPLATES = Path(__file__).parent / "data" / "templates"
LIMITS = Limits(max_tokens=512, model_id="m", draft=True)
# template file → (family, bos, the end-of-turn text a model writes after its answer)
FAMILY_TEMPLATES = {
    "Qwen-Qwen3-0.6B": ("qwen-json", "", "<|im_end|>"),
    "Qwen3.5-4B": ("qwen-xml", "", "<|im_end|>"),
    "Qwen3-Coder": ("qwen-xml", "", "<|im_end|>"),
    "meta-llama-Llama-3.1-8B-Instruct": ("llama3", "<|begin_of_text|>", "<|eot_id|>"),
    "mistralai-Mistral-Nemo-Instruct-2407": ("mistral", "<s>", "</s>"),
    "Mistral-Small-3.2-24B-Instruct-2506": ("mistral-args", "<s>", "</s>"),
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The local time in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


def formatter(name: str) -> TemplateFormatter:
    _, bos, eot = FAMILY_TEMPLATES.get(name, ("", "<bos>", "<eos>"))
    return TemplateFormatter(template(name), bos, eot)


def chat_request(messages: list[dict], **fields) -> "object":
    return parse_request({"messages": messages, **fields}, "chat", LIMITS)


def read(plan: AnswerPlan, text: str, pieces: int = 1, seed: int = 0) -> tuple[dict, str, list[dict]]:
    """The answer through AnswerStream, whole (pieces=1) or cut at random places; (message, finish, deltas)."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(pieces - 1, len(text) - 1))) if pieces > 1 else []
    stream, deltas, at = AnswerStream(plan, new_id=iter(f"call_{i}" for i in range(99)).__next__), [], 0
    for cut in cuts + [len(text)]:
        deltas += stream.feed(text[at:cut])
        at = cut
    deltas += stream.flush()
    return merge(deltas), stream.finish_reason("stop"), deltas


def calls_of(message: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]


# ---- which templates have tools, and in which format ---------------------------------------------
@pytest.mark.parametrize("name", list(FAMILY_TEMPLATES))
def test_each_family_is_told_from_its_template(name):
    assert template_family(template(name)) == FAMILY_TEMPLATES[name][0]


@pytest.mark.parametrize("name", ["google-gemma-2-2b-it", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "GLM-4.6"])
def test_a_template_without_tools_has_no_family_and_a_tools_request_is_a_400(name):
    """Gemma's and R1-Distill's never read `tools`; GLM's writes <tool_call> in a format of its own (arg_key)."""
    assert template_family(template(name)) is None
    req = chat_request([{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS)
    with pytest.raises(ApiError) as e:
        render_chat(formatter(name), None, think_format(template(name)), req)
    assert (e.value.status, e.value.param, e.value.code) == (400, "tools", "unsupported_parameter")


# ---- the parsers read what each template writes --------------------------------------------------
def _assistant_turn(name: str, calls: list[dict]) -> tuple[str, AnswerPlan]:
    """What the template writes for an assistant turn with `calls` (the text a model trained on it would
    generate), cut from the rendered conversation after the prompt, and the plan the server would use."""
    fmt = formatter(name)
    user = [{"role": "user", "content": "Weather and time in Paris and Lyon?"}]
    prompt, plan = render_chat(fmt, FAMILY_TEMPLATES[name][0], think_format(template(name)),
                               chat_request(user, tools=TOOLS))
    turn = {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call{i}abcd", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate((c["name"], c["arguments"]) for c in calls)]}
    full, _ = render_chat(fmt, plan.family, plan.think, chat_request(user + [turn], tools=TOOLS))
    assert full.startswith(prompt.rstrip("\n")), "the conversation's rendering does not extend the prompt's"
    tail = full[len(prompt.rstrip("\n")):]
    return tail[:tail.index(FAMILY_TEMPLATES[name][2])], plan


@pytest.mark.parametrize("name", list(FAMILY_TEMPLATES))
def test_the_parser_reads_back_the_calls_the_template_writes(name):
    calls = [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
             {"name": "get_time", "arguments": {"city": "Lyon"}}]
    if FAMILY_TEMPLATES[name][0] == "llama3":
        calls = calls[:1]  # Llama 3.x templates take one call per message
    text, plan = _assistant_turn(name, calls)
    message, finish, _ = read(plan, text)
    assert calls_of(message) == [(c["name"], c["arguments"]) for c in calls], text
    assert finish == "tool_calls" and not message["content"], message


CANNED = {  # family → (text then one call, parallel calls) as models of that family write them
    "qwen-json": ('Let me look that up.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                  '"days": 2}}\n</tool_call>',
                  '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
                  '<tool_call>\n{"name": "get_time", "arguments": {"city": "Lyon \\"centre\\" {x}"}}\n</tool_call>'),
    "qwen-xml": ("Let me look that up.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>"
                 "\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
                 "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
                 "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=city>\n"
                 'Lyon "centre" {x}\n</parameter>\n</function>\n</tool_call>'),
    "llama3": (None, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
                     '{"name": "get_time", "parameters": {"city": "Lyon \\"centre\\" {x}"}}'),
    "mistral": ('Let me look that up.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]',
                '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}, "id": "a1b2c3d4e"}, '
                '{"name": "get_time", "arguments": {"city": "Lyon \\"centre\\" {x}"}}]'),
    "mistral-args": ('Let me look that up.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}',
                     '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]get_time[ARGS]'
                     '{"city": "Lyon \\"centre\\" {x}"}'),
}
PARIS = ("get_weather", {"city": "Paris", "days": 2})
LYON = ("get_time", {"city": 'Lyon "centre" {x}'})


@pytest.mark.parametrize("family", list(CANNED))
def test_auto_keeps_the_text_before_a_call_as_content(family):
    text = CANNED[family][0]
    if text is None:  # a Llama 3.x call is the whole message: no text before it
        text = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'
    message, finish, _ = read(AnswerPlan(family, SCHEMAS), text)
    assert calls_of(message) == [PARIS] and finish == "tool_calls"
    assert message["content"] == (None if family == "llama3" else "Let me look that up.")


@pytest.mark.parametrize("family", list(CANNED))
def test_parallel_calls_are_each_parsed_with_call_ids(family):
    message, finish, _ = read(AnswerPlan(family, SCHEMAS), CANNED[family][1])
    assert calls_of(message) == [PARIS, LYON] and finish == "tool_calls"
    ids = [c["id"] for c in message["tool_calls"]]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    one, _, _ = read(AnswerPlan(family, SCHEMAS, parallel=False), CANNED[family][1])
    assert calls_of(one) == [PARIS]  # parallel_tool_calls false: the first call only


@pytest.mark.parametrize("family", list(CANNED))
def test_plain_text_and_text_that_only_looks_like_a_call_stay_content(family):
    for text in ("The weather in Paris is mild.", 'Use JSON like {"city": "Paris"} in braces.'):
        message, finish, _ = read(AnswerPlan(family, SCHEMAS), text, pieces=7)
        assert message == {"role": "assistant", "content": text} and finish == "stop"


@pytest.mark.parametrize("family", list(CANNED))
def test_streamed_deltas_assemble_into_the_same_calls_with_valid_json(family):
    whole, _, _ = read(AnswerPlan(family, SCHEMAS), CANNED[family][1])
    for seed in range(5):
        streamed, finish, deltas = read(AnswerPlan(family, SCHEMAS), CANNED[family][1], pieces=40, seed=seed)
        assert calls_of(streamed) == calls_of(whole) and finish == "tool_calls"
        calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
        heads = [c for c in calls if "id" in c]
        assert [h["index"] for h in heads] == [0, 1]
        assert all(h["function"]["arguments"] == "" and h["type"] == "function" for h in heads)
        fragments = [c for c in calls if "id" not in c]
        assert len(fragments) > 2, "the arguments came in one piece: not streamed"
        assert not any("content" in d for d in deltas)


def test_a_call_cut_by_max_tokens_is_not_presented_as_finished():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    stream = AnswerStream(AnswerPlan("qwen-json", SCHEMAS))
    deltas = stream.feed(text) + stream.flush()
    assert stream.n_calls == 1 and stream.finish_reason("stop") == "stop" and stream.finish_reason("length") == "length"
    assert merge(deltas)["tool_calls"][0]["function"]["arguments"] == '{"city": "Par'


# ---- rendering: tools and tool results reach the prompt -------------------------------------------
@pytest.mark.parametrize("name", list(FAMILY_TEMPLATES))
def test_tools_appear_in_the_rendered_prompt_and_tool_choice_none_leaves_them_out(name):
    fmt, family = formatter(name), FAMILY_TEMPLATES[name][0]
    user = [{"role": "user", "content": "Weather in Paris?"}]
    prompt, plan = render_chat(fmt, family, None, chat_request(user, tools=TOOLS))
    assert "get_weather" in prompt and "The local time in a city" in prompt and plan.family == family
    plain, plan = render_chat(fmt, family, None, chat_request(user, tools=TOOLS, tool_choice="none"))
    assert "get_weather" not in plain and plan.family is None


@pytest.mark.parametrize("name", list(FAMILY_TEMPLATES))
def test_a_tool_result_round_trips_into_the_next_prompt(name):
    """OpenAI's shapes: the assistant's call (content null, arguments a JSON string, a `call_` id) and the
    tool message answering it by tool_call_id (Mistral's templates need 9-character ids: mapped)."""
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_8f2a61c0d9e14b7fa3c5", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
                {"role": "tool", "tool_call_id": "call_8f2a61c0d9e14b7fa3c5", "content": "Sunny, 24 C"}]
    prompt, _ = render_chat(formatter(name), FAMILY_TEMPLATES[name][0], None, chat_request(messages, tools=TOOLS))
    assert "Sunny, 24 C" in prompt and "Paris" in prompt[prompt.index("get_weather", prompt.index("Weather in")):]


def test_chat_template_kwargs_reach_the_template():
    fmt, user = formatter("Qwen-Qwen3-0.6B"), [{"role": "user", "content": "hi"}]
    on, _ = render_chat(fmt, "qwen-json", ThinkFormat(), chat_request(user))
    off, plan = render_chat(fmt, "qwen-json", ThinkFormat(),
                            chat_request(user, chat_template_kwargs={"enable_thinking": False}))
    assert off == on + "<think>\n\n</think>\n\n" and not plan.in_thinking


# ---- reasoning -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name, kwargs, opened", [
    ("Qwen-Qwen3-0.6B", None, False),  # the model writes <think> itself
    ("Qwen3.5-4B", None, True), ("Qwen3.5-4B", {"enable_thinking": False}, False),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", {"enable_thinking": True}, True),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", None, False),  # llama.cpp's copy closes it unless asked
])
def test_thinking_templates_and_whether_the_prompt_opens_the_thinking(name, kwargs, opened):
    fmt = think_format(template(name))
    assert fmt == ThinkFormat("<think>", "</think>")
    prompt, plan = render_chat(formatter(name), None, fmt, chat_request([{"role": "user", "content": "hi"}],
                                                                        chat_template_kwargs=kwargs))
    assert opens_thinking(prompt, fmt) is opened and plan.in_thinking is opened


def test_templates_that_do_not_think_have_no_markers():
    assert think_format(template("meta-llama-Llama-3.1-8B-Instruct")) is None
    assert think_format(template("google-gemma-2-2b-it")) is None


THOUGHT = "The user wants 2+2.\n\nThat is 4."


@pytest.mark.parametrize("text, in_thinking", [(f"<think>\n{THOUGHT}\n</think>\n\nIt is 4.", False),
                                               (f"\n{THOUGHT}\n</think>\n\nIt is 4.", True)])
def test_reasoning_is_split_from_the_answer_whole_and_streamed(text, in_thinking):
    assert split_reasoning(text, ThinkFormat(), in_thinking) == (THOUGHT, "It is 4.")
    plan = AnswerPlan(think=ThinkFormat(), in_thinking=in_thinking)
    for pieces in (1, 5, len(text)):
        message, _, deltas = read(plan, text, pieces=pieces)
        assert (message["reasoning_content"], message["content"]) == (THOUGHT, "It is 4.")
        assert not any("<think>" in (d.get("content", "") + d.get("reasoning_content", "")) for d in deltas)


def test_a_thinking_model_answering_without_thinking_and_one_cut_while_thinking():
    assert split_reasoning("It is 4.", ThinkFormat(), False) == ("", "It is 4.")
    assert split_reasoning("Still working on", ThinkFormat(), True) == ("Still working on", "")


def test_tool_calls_are_parsed_from_the_answer_only():
    plan = AnswerPlan("qwen-json", SCHEMAS, think=ThinkFormat(), in_thinking=True)
    text = ('I could write <tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n</tool_call> here.\n'
            '</think>\n\n' + CANNED["qwen-json"][0])
    message, finish, _ = read(plan, text, pieces=30)
    assert calls_of(message) == [PARIS] and finish == "tool_calls"
    assert "get_time" in message["reasoning_content"] and message["content"] == "Let me look that up."


# ---- the request's fields ------------------------------------------------------------------------
@pytest.mark.parametrize("fields, param, words", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice",
     "get_stock"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "twice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "'messages'"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, "messages",
     "messages[0].tool_calls[0].function.arguments"),
])
def test_bad_tool_fields_are_a_400_naming_the_field(fields, param, words):
    with pytest.raises(ApiError) as e:
        chat_request(fields.pop("messages", [{"role": "user", "content": "hi"}]), **fields)
    assert (e.value.status, e.value.param) == (400, param) and words in e.value.message, e.value.message


def test_tool_fields_on_completions_are_refused():
    with pytest.raises(ApiError) as e:
        parse_request({"prompt": "hi", "tools": TOOLS}, "completion", LIMITS)
    assert e.value.param == "tools"


@pytest.mark.parametrize("kwargs, after", [(None, "</think>"), ({"enable_thinking": False}, None)])
def test_a_forced_call_waits_for_the_end_of_an_opened_thinking(kwargs, after):
    """Qwen3.5's prompt opens the thinking: the call grammar starts after </think>; with thinking off the
    prompt closes it and the grammar holds the answer from its first token."""
    req = chat_request([{"role": "user", "content": "hi"}], tools=TOOLS, tool_choice="required",
                       chat_template_kwargs=kwargs)
    _, plan = render_chat(formatter("Qwen3.5-4B"), "qwen-xml", ThinkFormat(), req)
    assert plan.forced is req.tools and plan.forced.choice == "required"
    grammar, start = call_grammar(plan, lambda text, special: [ord(c) for c in text])
    assert start == after and "reasoning" not in grammar and grammar.startswith("start: call")


def test_a_forced_call_on_a_model_that_may_think_first():
    """Qwen3's prompt leaves the choice to the model: the grammar lets a thinking part come first."""
    req = chat_request([{"role": "user", "content": "hi"}], tools=TOOLS,
                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    _, plan = render_chat(formatter("Qwen-Qwen3-0.6B"), "qwen-json", ThinkFormat(), req)
    grammar, start = call_grammar(plan, lambda text, special: [1] if special and text == "</think>" else [2, 3])
    assert start is None and grammar.startswith('start: ("<think>" reasoning') and "<[1]>" in grammar
    assert "get_weather" not in grammar and "get_time" in grammar


# ---- the grammar that forces a call, checked by llguidance ----------------------------------------
llguidance = pytest.importorskip("llguidance")
MARKERS = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<think>", "</think>"]


class ByteTokenizer:
    """One token per byte, plus the call markers as special tokens and an end of sequence."""

    def __init__(self):
        self.tokens = [bytes([i]) for i in range(256)] + [b"\xff" + m.encode() for m in MARKERS] + [b"\xff<eos>"]
        self.eos_token_id, self.bos_token_id = len(self.tokens) - 1, None
        self.special_token_ids = list(range(256, len(self.tokens)))

    def __call__(self, text):
        return list(text)


SPECIALS = {m: 256 + i for i, m in enumerate(MARKERS)}


@pytest.fixture(scope="module")
def tokenizer():
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(ByteTokenizer()))


def _tokens(text: str) -> list[int]:
    out, at = [], 0
    while at < len(text):
        m = next((m for m in MARKERS if text.startswith(m, at)), None)
        out += [SPECIALS[m]] if m else list(text[at].encode())
        at += len(m) if m else 1
    return out


def accepts(tokenizer, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    tokens = _tokens(text)
    return matcher.validate_tokens(tokens) == len(tokens) and matcher.consume_tokens(tokens) and \
        matcher.is_accepting()


BAD = {  # family → calls a forcing grammar must refuse: an unknown function, arguments against the schema
    "qwen-json": ['<tool_call>\n{"name": "get_stock", "arguments": {"city": "Paris"}}\n</tool_call>',
                  '<tool_call>\n{"name": "get_weather", "arguments": {"days": 2}}\n</tool_call>'],
    "qwen-xml": ["<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
                 "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n"
                 "two\n</parameter>\n</function>\n</tool_call>"],
    "llama3": ['{"name": "get_stock", "parameters": {"city": "Paris"}}', '{"name": "get_weather", "parameters": {}}'],
    "mistral": ['[TOOL_CALLS][]', '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": 3}}]'],
    "mistral-args": ['[TOOL_CALLS]get_stock[ARGS]{}', '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "x": 1}'],
}
GOOD = {family: texts[1] if family != "llama3" else texts[1].split("; ")[0].replace("<|python_tag|>", "")
        for family, texts in CANNED.items()}


@pytest.mark.parametrize("family", list(CANNED))
def test_the_forcing_grammar_accepts_the_calls_the_parser_reads_and_refuses_malformed_ones(tokenizer, family):
    tools = [WEATHER, {**TIME, "function": {**TIME["function"], "parameters": {**SCHEMAS["get_time"],
                                                                            "additionalProperties": False}}}]
    tools[0]["function"]["parameters"]["additionalProperties"] = False
    grammar = tool_call_grammar(family, tools, specials=SPECIALS)
    assert llguidance.LLMatcher.validate_grammar(grammar, tokenizer) == ""
    assert accepts(tokenizer, grammar, GOOD[family]), grammar
    assert calls_of(read(AnswerPlan(family, SCHEMAS), GOOD[family])[0])[0] == PARIS
    for bad in BAD[family] + ["The weather is fine.", ""]:
        assert not accepts(tokenizer, grammar, bad), bad


@pytest.mark.parametrize("family", ["qwen-json", "qwen-xml", "mistral", "mistral-args"])
def test_a_named_function_and_parallel_false_narrow_the_grammar(tokenizer, family):
    one = tool_call_grammar(family, TOOLS, name="get_weather", parallel=False, specials=SPECIALS)
    assert not accepts(tokenizer, one, GOOD[family])  # two calls, the second to another function
    named = tool_call_grammar(family, TOOLS, name="get_time", specials=SPECIALS)
    assert not accepts(tokenizer, named, CANNED[family][0].replace("Let me look that up.", ""))


@pytest.mark.parametrize("family", list(CANNED))
@pytest.mark.parametrize("parallel", [None, True, False])
def test_a_named_choice_is_exactly_one_call_whatever_parallel_tool_calls_says(tokenizer, family, parallel):
    """OpenAI: a named tool_choice is a call to exactly that function. The request's plan and the grammar built
    from it take one call of it (then the end); a second call of the same function is refused, in every format."""
    fields = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    if parallel is not None:
        fields["parallel_tool_calls"] = parallel
    req = chat_request([{"role": "user", "content": "hi"}], **fields)
    assert req.tools.parallel is False
    plan = AnswerPlan(family, SCHEMAS, parallel=req.tools.parallel, forced=req.tools)
    grammar, after = call_grammar(plan, lambda text, special: _tokens(text) if special else list(text.encode()))
    one = GOOD[family].split("\n<tool_call>")[0].split("[TOOL_CALLS]get_time")[0]
    if family == "mistral":
        one = one.split(", {")[0] + "]"
    assert after is None and accepts(tokenizer, grammar, one), one
    twice = {"llama3": one + "; " + one, "mistral": one[:-1] + ", " + one[len("[TOOL_CALLS]["):]}.get(family,
                                                                                                  one + "\n" + one)
    if family == "mistral-args":
        twice = one + one
    assert not accepts(tokenizer, grammar, twice), twice
    message, _, _ = read(plan, twice)
    assert calls_of(message) == [PARIS]  # and the reader keeps one call


def test_markers_the_vocabulary_lacks_are_spelled_as_text(tokenizer):
    grammar = tool_call_grammar("qwen-json", TOOLS)
    text = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n</tool_call>'
    assert accepts(tokenizer, grammar, text) is False  # the text form is tokenized to the special token here
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    assert matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


CALL = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n</tool_call>'


@pytest.mark.parametrize("as_tokens", [True, False], ids=["special-tokens", "text-markers"])
def test_the_grammar_applies_after_the_thinking(tokenizer, as_tokens):
    """Reasoning is free up to the end marker (even text that looks like a call); the call is forced after it."""
    specials = SPECIALS if as_tokens else {}
    call = tool_call_grammar("qwen-json", TOOLS, specials=specials)
    opened = with_thinking(call, ThinkFormat(), in_thinking=True, specials=specials)
    closed = with_thinking(call, ThinkFormat(), in_thinking=False, specials=specials)

    def ok(grammar, text):
        if as_tokens:
            return accepts(tokenizer, grammar, text)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()

    assert ok(opened, "Rome, so get_time <tool_call> maybe.\n</think>\n\n" + CALL)
    assert not ok(opened, "Rome.\n</think>\n\nIt is noon.")  # the answer must be the call
    assert not ok(opened, CALL)  # the prompt opened the thinking: it must be closed first
    assert ok(closed, CALL) and ok(closed, "<think>\nRome.\n</think>\n" + CALL)
    assert not ok(closed, "Rome.\n</think>\n" + CALL)


def test_marker_tokens_are_the_markers_the_vocabulary_holds_whole():
    vocab = {"<tool_call>": 7}

    def tokenize(text, parse_special):
        return [vocab[text]] if parse_special and text in vocab else [ord(c) for c in text]

    assert marker_tokens(["<tool_call>", "</tool_call>", "x"], tokenize) == {"<tool_call>": 7}


def test_the_forced_grammar_of_a_thinking_qwen35_request(tokenizer):
    """What a `tool_choice: required` request on Qwen3.5's template (XML calls, thinking opened) is held to."""
    prompt, plan = render_chat(formatter("Qwen3.5-4B"), "qwen-xml", ThinkFormat(), chat_request(
        [{"role": "user", "content": "Time in Rome?"}], tools=TOOLS))
    grammar = forced_call_grammar(plan.family, TOOLS, None, plan.parallel, plan.think, plan.in_thinking, SPECIALS)
    call = "<tool_call>\n<function=get_time>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>"
    assert accepts(tokenizer, grammar, "Rome is in Italy.\n</think>\n\n" + call)
    assert not accepts(tokenizer, grammar, "Rome is in Italy.\n</think>\n\nIt is noon.")
    message, finish, _ = read(plan, "Rome is in Italy.\n</think>\n\n" + call)
    assert calls_of(message) == [("get_time", {"city": "Rome"})] and finish == "tool_calls"


def test_a_long_xml_string_argument_streams_as_the_model_writes_it():
    """Qwen3-Coder and Qwen3.5 write a file's text as a <parameter>: it streams, newlines and quotes in it
    kept, the newline before the closing tag not."""
    body = 'def f():\n    return "x"\n\n# end'
    text = f"<tool_call>\n<function=get_time>\n<parameter=city>\n{body}\n</parameter>\n</function>\n</tool_call>"
    message, finish, deltas = read(AnswerPlan("qwen-xml", SCHEMAS), text, pieces=len(text))
    assert calls_of(message) == [("get_time", {"city": body})] and finish == "tool_calls"
    fragments = [d["tool_calls"][0]["function"]["arguments"] for d in deltas if "id" not in d["tool_calls"][0]]
    assert len(fragments) > len(body) // 2, fragments
