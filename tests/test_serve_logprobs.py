"""`logprobs` through the real server and the `openai` client: the values of a drafted run equal those of the
same request on the target alone (`draft_max: 0`) within the batch-vs-single rounding, streamed as well, in
OpenAI's chat and completions shapes; one sequence at a time and with --parallel 2."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")

from serve_proc import ServerProc  # noqa: E402

TOL = 0.05  # batch-vs-single rounding (INTERFACES.md)
PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import numpy as np\n", "Once upon a time, there"]


@pytest.fixture(scope="module", params=[1, 2], ids=["parallel1", "parallel2"])
def url(request, tiny_target, tiny_close, tmp_path_factory):
    srv = ServerProc(["--target", str(tiny_target), "--draft", str(tiny_close), "--draft-max", "4", "--threads",
                      "1", "--parallel", str(request.param)], tmp_path_factory.mktemp("lp") / "serve.log")
    try:
        yield srv.url
    finally:
        srv.stop()


def client(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0)


def chat(c, prompt: str, draft_max: int, **kw):
    return c.chat.completions.create(model="target", messages=[{"role": "user", "content": prompt}], max_tokens=24,
                                     temperature=0, logprobs=True, top_logprobs=5, extra_body={"draft_max": draft_max},
                                     **kw)


def same_logprobs(a: list, b: list) -> None:
    assert [t.token for t in a] == [t.token for t in b]
    for x, y in zip(a, b):
        assert x.logprob == pytest.approx(y.logprob, abs=TOL)
        alts = {tuple(t.bytes): t.logprob for t in y.top_logprobs}  # (two tokens may print alike)
        assert len(x.top_logprobs) == 5
        for t in x.top_logprobs:
            if tuple(t.bytes) in alts:  # (a near-tie at the fifth place may swap one alternative)
                assert t.logprob == pytest.approx(alts[tuple(t.bytes)], abs=TOL)
        assert len(set(alts) & {tuple(t.bytes) for t in x.top_logprobs}) >= 4


def test_drafted_logprobs_equal_the_target_alone(url):
    c = client(url)
    with ThreadPoolExecutor(2) as pool:  # with --parallel 2 the two share verify decodes
        runs = list(pool.map(lambda p: (chat(c, p, 4), chat(c, p, 0)), PROMPTS))
    drafted = 0
    for spec, plain in runs:
        assert spec.choices[0].message.content == plain.choices[0].message.content
        lp = spec.choices[0].logprobs.content
        assert lp and len({t.token for t in lp}) > 3
        text = b"".join(bytes(t.bytes) for t in lp).decode("utf-8", errors="replace")
        assert text == spec.choices[0].message.content
        same_logprobs(lp, plain.choices[0].logprobs.content)
        assert all(t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=TOL) for t in lp)  # greedy
        assert all(bytes(t.bytes).decode("utf-8", errors="replace") == t.token for t in lp)
        drafted += spec.usage.model_extra["speculative"]["n_drafted"]
        assert plain.usage.model_extra["speculative"] is None
    assert drafted > 0


def test_streamed_logprobs_assemble_to_the_whole_answers(url):
    c = client(url)
    whole = chat(c, PROMPTS[0], 4)
    entries, text = [], ""
    for ch in chat(c, PROMPTS[0], 4, stream=True):
        if ch.choices and ch.choices[0].logprobs is not None:
            entries += ch.choices[0].logprobs.content
        if ch.choices and ch.choices[0].delta.content:
            text += ch.choices[0].delta.content
    assert text == whole.choices[0].message.content
    same_logprobs(entries, whole.choices[0].logprobs.content)


def test_completions_logprobs_shape(url):
    c = client(url)
    got = c.completions.create(model="target", prompt=PROMPTS[1], max_tokens=20, temperature=0, logprobs=3)
    ch = got.choices[0]
    lp = ch.logprobs
    assert ch.text and len(lp.tokens) > 3
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(1 <= len(top) <= 3 and max(top.values()) == pytest.approx(v, abs=TOL)
               for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    off = c.completions.create(model="target", prompt=PROMPTS[1], max_tokens=20, temperature=0)
    assert off.choices[0].logprobs is None and off.choices[0].text == ch.text
