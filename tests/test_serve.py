"""`specq serve` end to end: the real server in a subprocess on a free loopback port with a tiny pair, driven by
the real `openai` client (raw HTTP only for what the client cannot send)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")

from cli_bin import SPECQ  # noqa: E402
from serve_proc import ServerProc, http  # noqa: E402

CLIENT_TIMEOUT_S = 120
PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Speculative decoding drafts", "for i in range(10):",
           "The dog sleeps in the sun", "numbers 12345", "return fibonacci(n - 1)", "a small model and verifies"]
# Every generation drafts (a fixed length; "auto" may choose not to draft on models this small) and uses one thread.
PAIR_ARGS = ["--draft-max", "4", "--threads", "1", "--max-tokens", "3000"]


def client(url: str, api_key: str = "none") -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, timeout=CLIENT_TIMEOUT_S, max_retries=0)


@pytest.fixture(scope="module")
def server(tiny_target, tiny_close, tmp_path_factory):
    srv = ServerProc(["--target", str(tiny_target), "--draft", str(tiny_close), *PAIR_ARGS],
                     tmp_path_factory.mktemp("serve") / "serve.log")
    try:
        yield srv
    finally:
        srv.stop()


def chat(c, text: str, **kw):
    return c.chat.completions.create(model="target", messages=[{"role": "user", "content": text}], **kw)


# ---- the endpoints ----------------------------------------------------------------------------------
def test_models_lists_the_target_stem_and_health_answers(server):
    models = client(server.url).models.list()
    assert [m.id for m in models.data] == ["target"]
    status, body = http(f"{server.url}/health")
    assert status == 200 and json.loads(body)["status"] == "ok"


def test_chat_stream_and_non_stream_agree(server):
    c = client(server.url)
    full = chat(c, PROMPTS[0], max_tokens=40, temperature=0)
    assert full.choices[0].finish_reason in ("stop", "length")
    spec = full.usage.model_extra["speculative"]
    assert spec["n_drafted"] > 0 and 0 <= spec["accept_rate"] <= 1 and spec["verify_ms"] > 0
    assert full.usage.completion_tokens > 0 and full.usage.total_tokens == full.usage.prompt_tokens + \
        full.usage.completion_tokens

    chunks = list(chat(c, PROMPTS[0], max_tokens=40, temperature=0, stream=True,
                       stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert text == full.choices[0].message.content
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.model_extra["speculative"]["n_drafted"] > 0


def test_draft_max_0_runs_the_target_alone(server):
    c = client(server.url)
    spec = c.completions.create(model="target", prompt=PROMPTS[5], max_tokens=24, temperature=0)
    alone = c.completions.create(model="target", prompt=PROMPTS[5], max_tokens=24, temperature=0,
                                 extra_body={"draft_max": 0})
    assert alone.choices[0].text == spec.choices[0].text
    assert alone.usage.model_extra["speculative"] is None and spec.usage.model_extra["speculative"]["n_drafted"] > 0


def test_a_lone_answer_takes_its_first_token_from_its_prompts_decode(server):
    """The prompt's last token is evaluated with the prompt (a folded prefill): an answer of n tokens alone on
    the server costs the target n decodes, the prompt's one included, as llama-server's (n + 1 before)."""
    c = client(server.url)
    key = 'specq:decodes{model="target"}'
    d0 = server.metrics()[key]
    out = c.completions.create(model="target", prompt="Write the twelve months of the year, one a line:",
                               max_tokens=12, temperature=0, extra_body={"draft_max": 0})
    n = out.usage.completion_tokens
    assert n > 1 and server.metrics()[key] - d0 == n


def test_a_request_may_pick_the_ngram_drafter(server):
    c = client(server.url)
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    plain = c.completions.create(model="target", prompt=prompt, max_tokens=40, temperature=0)
    ngram = c.completions.create(model="target", prompt=prompt, max_tokens=40, temperature=0,
                                 extra_body={"drafter": "ngram"})
    assert ngram.choices[0].text == plain.choices[0].text
    assert ngram.usage.model_extra["speculative"]["n_drafted"] > 0, ngram.choices[0].text


def test_metrics_count_every_draft_token_the_target_verified(server, tiny_target, tiny_close, monkeypatch):
    """/metrics' llamacpp:spec_decode_num_draft_tokens_total counts what llama-server counts: every draft token
    verified. The reference: the same request run in this process, with each step's verified drafts summed."""
    from specq.native.runtime.engine import Engine
    from specq.native.core.settings import GenerationSettings
    from specq.native.runtime import step as speculative

    prompt, n = PROMPTS[2], 40
    verified, real = [], speculative.step

    def spy(asks):
        steps = real(asks)
        verified.extend(s.n_drafted for s in steps)
        return steps

    monkeypatch.setattr(speculative, "step", spy)
    with Engine(tiny_target, tiny_close, ctx=4096, threads=1) as e:
        g = e.session().generate(e.tokenize(prompt), GenerationSettings(n_predict=n, draft_max=4)).run()
    assert g.stats.stop_reason == "n_predict" and g.stats.n_accepted < sum(verified)  # some drafts rejected

    key = "llamacpp:spec_decode_num_draft_tokens_total"
    before = server.metrics().get(key, 0.0)
    resp = client(server.url).completions.create(model="target", prompt=prompt, max_tokens=n, temperature=0,
                                                 extra_body={"cache_prompt": False})
    spec = resp.usage.model_extra["speculative"]
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == n
    assert server.metrics()[key] - before == spec["n_drafted"] == sum(verified)
    assert spec["accept_rate"] == pytest.approx(spec["n_accepted"] / sum(verified))
    assert spec["alpha"] > spec["accept_rate"]


def _bench_text(target, draft, prompt: str, n: int, chat_mode: bool) -> str:
    """The target-alone text `specq bench` generates for a prompt."""
    argv = [SPECQ, "bench", "--target", str(target), "--draft", str(draft), "--prompt", prompt, "--n-predict",
            str(n), "--draft-max", "4", "--threads", "1", "--json", "-", "-q"] + (["--chat"] if chat_mode else [])
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    (base,) = [run for run in doc["runs"] if run["mode"] == "baseline"]
    return base["text"]


@pytest.mark.parametrize("chat_mode", [False, True], ids=["completion", "chat"])
def test_greedy_output_equals_bench_target_alone(server, tiny_target, tiny_close, chat_mode):
    c = client(server.url)
    prompt, n = PROMPTS[1], 48
    if chat_mode:
        resp = chat(c, prompt, max_tokens=n, temperature=0)
        text = resp.choices[0].message.content
    else:
        resp = c.completions.create(model="target", prompt=prompt, max_tokens=n, temperature=0)
        text = resp.choices[0].text
    assert resp.usage.model_extra["speculative"]["n_drafted"] > 0
    assert len(text) > 10
    assert text == _bench_text(tiny_target, tiny_close, prompt, n, chat_mode)


# ---- concurrency ------------------------------------------------------------------------------------
def _run_all(url: str, prompts: list[str], concurrent: bool, **kw) -> list:
    def one(i):
        return chat(client(url), prompts[i], max_tokens=32, seed=1000 + i, **kw)

    if not concurrent:
        return [one(i) for i in range(len(prompts))]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(one, i) for i in range(len(prompts))]
        return [f.result(timeout=CLIENT_TIMEOUT_S) for f in futures]


# A seeded sample reproduces only from an empty cache: a kept prefix was computed inside another request's
# batch (whose shape changes its last bits), and at temperature 0.8 that can move one draw. Greedy is robust.
@pytest.mark.parametrize("sampling", [{"temperature": 0},
                                      {"temperature": 0.8, "extra_body": {"draft_max": 3, "cache_prompt": False}}],
                         ids=["greedy", "temp0.8-seeded"])
def test_eight_concurrent_clients_match_their_serial_runs(server, sampling):
    before = server.metrics()
    serial = _run_all(server.url, PROMPTS, concurrent=False, **sampling)
    together = _run_all(server.url, PROMPTS, concurrent=True, **sampling)
    for a, b in zip(serial, together, strict=True):
        assert b.choices[0].message.content == a.choices[0].message.content
        assert a.usage.model_extra["speculative"]["n_drafted"] > 0
    after = server.metrics()
    # every chat prompt starts with the template's "<|im_start|>user\n": the cached prefix was reused, unless
    # the request said cache_prompt false
    reused = after["specq:prompt_tokens_reused_total"] - before.get("specq:prompt_tokens_reused_total", 0)
    assert reused == 0 if "cache_prompt" in sampling.get("extra_body", {}) else reused > 0
    assert after["llamacpp:spec_decode_num_drafts_total"] > before["llamacpp:spec_decode_num_drafts_total"]


# ---- stop strings, cancellation ----------------------------------------------------------------------
def _stop_candidates(text: str) -> list[int]:
    """Positions where a 2-character printable string first occurs (a usable stop string)."""
    return [i for i in range(4, len(text) - 2)
            if text[i:i + 2].isprintable() and "\ufffd" not in text[i:i + 2] and text.find(text[i:i + 2]) == i]


def test_stop_string_inside_a_step_truncates_and_rolls_back(server):
    c = client(server.url)
    prompt = PROMPTS[2]
    expected = c.completions.create(model="target", prompt=prompt, max_tokens=80, temperature=0).choices[0].text
    rolled_back = 0
    for i in _stop_candidates(expected)[:12]:
        stop = expected[i:i + 2]
        m0 = server.metrics()["llamacpp:tokens_predicted_total"]
        r = c.completions.create(model="target", prompt=prompt, max_tokens=80, temperature=0, stop=[stop])
        generated = server.metrics()["llamacpp:tokens_predicted_total"] - m0
        assert r.choices[0].text == expected[:i] and r.choices[0].finish_reason == "stop"
        # tokens the step produced after the stop string: generated but not kept, then rolled back
        rolled_back += generated - r.usage.completion_tokens
        again = c.completions.create(model="target", prompt=prompt, max_tokens=80, temperature=0)
        assert again.choices[0].text == expected
        streamed = "".join(ch.choices[0].text for ch in c.completions.create(
            model="target", prompt=prompt, max_tokens=80, temperature=0, stop=stop, stream=True))
        assert streamed == expected[:i]
        if rolled_back:
            break
    assert rolled_back > 0, "no stop string ended inside a multi-token step"


def test_disconnect_mid_stream_cancels_and_the_next_answer_is_exact(server):
    c = client(server.url)
    expected = chat(c, PROMPTS[3], max_tokens=40, temperature=0).choices[0].message.content
    before = server.metrics()
    stream = chat(c, PROMPTS[4], max_tokens=2900, temperature=0, stream=True)
    for n, _ in enumerate(stream):
        if n == 3:
            break
    stream.close()
    cancelled = 0
    for _ in range(300):  # up to 30 s for the server to notice
        m = server.metrics()
        cancelled = m["specq:requests_cancelled_total"] - before["specq:requests_cancelled_total"]
        if cancelled and m["llamacpp:requests_processing"] == 0:
            break
        threading.Event().wait(0.1)
    assert cancelled == 1
    # it stopped within a step or so of the disconnect, far from its 2900 tokens
    assert m["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] < 2000
    assert chat(c, PROMPTS[3], max_tokens=40, temperature=0).choices[0].message.content == expected


# ---- bad requests -------------------------------------------------------------------------------------
def _error(status_body) -> tuple[int, dict]:
    status, body = status_body
    err = json.loads(body)["error"]
    assert set(err) >= {"message", "type", "code"} and err["message"]
    return status, err


@pytest.mark.parametrize("body, status, code", [
    (b"{not json", 400, "invalid_json"),
    (b"[1, 2]", 400, "invalid_json"),
    ({"messages": "hello"}, 400, "invalid_type"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, 400, "invalid_type"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}, 400, "invalid_value"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": True}, 400, "invalid_type"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}, 400, "invalid_value"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4o"}, 404, "model_not_found"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": "yes"}, 400, "invalid_type"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, 400, "invalid_value"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, 400, "invalid_value"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "invalid_value"),
    # the tiny models' template never reads `tools`
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}, 400, "invalid_value"),
    ({"messages": [{"role": "user", "content": "hi"}], "draft_max": -1}, 400, "invalid_value"),
    ({"messages": [{"role": "user", "content": "hi"}], "accept": "maybe"}, 400, "invalid_value"),
    ({"messages": [{"role": "user", "content": "the quick brown fox " * 3000}]}, 400, "context_length_exceeded"),
], ids=["invalid-json", "not-an-object", "messages-type", "max-tokens-type", "negative-max-tokens", "bool-temp",
        "over-max-tokens", "unknown-model", "n2", "logprobs-type", "top-logprobs-alone", "top-logprobs-21", "bad-tool",
        "tools-no-template", "response-format", "draft-max-negative", "accept", "prompt-too-long"])
def test_bad_requests_get_an_openai_error(server, body, status, code):
    got, err = _error(http(f"{server.url}/v1/chat/completions", body))
    assert (got, err["code"]) == (status, code), err
    assert "Traceback" not in err["message"]


@pytest.mark.parametrize("route, body, param, what", [
    ("completions", {"prompt": "a \udcff b"}, "prompt", "'prompt'"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi \ud800"}]}, "messages",
     "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
     "messages", "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "us\udcffer", "content": "hi"}]}, "messages", "messages[0].role"),
    ("completions", {"prompt": "hi", "stop": ["ok", "\udcff"]}, "stop", "'stop' string 1"),
], ids=["prompt", "content", "content-part", "role", "stop"])
def test_a_lone_surrogate_is_a_400_naming_the_field(server, route, body, param, what):
    """Valid JSON ("\\udcff" on the wire) that no tokenizer can encode as UTF-8."""
    raw = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as the escape \udcff
    assert b"\\ud" in raw
    status, err = _error(http(f"{server.url}/v1/{route}", raw))
    assert (status, err["code"], err["param"]) == (400, "invalid_value", param), err
    assert err["message"].startswith(f"{what} is not valid UTF-8 text (a lone surrogate"), err
    assert server.proc.poll() is None and http(f"{server.url}/health")[0] == 200


def test_the_openai_client_sees_the_errors(server):
    c = client(server.url)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="target", prompt="hi", max_tokens=-1)
    assert "max_tokens" in e.value.body["message"]


def test_oversize_body_and_unknown_route(tiny_target, tmp_path):
    srv = ServerProc(["--target", str(tiny_target), "--threads", "1", "--max-body", "2048"], tmp_path / "s.log")
    try:
        status, err = _error(http(f"{srv.url}/v1/completions", {"prompt": "x" * 4000}))
        assert (status, err["code"]) == (413, "request_too_large")
        status, err = _error(http(f"{srv.url}/v1/embeddings", {"input": "x"}))
        assert status == 404
        # no draft: a plain target-alone answer, usage.speculative null
        r = client(srv.url).completions.create(model="target", prompt="The quick", max_tokens=8, temperature=0)
        assert r.usage.completion_tokens > 0 and r.usage.model_extra["speculative"] is None
    finally:
        assert srv.stop() == 0
    assert "Traceback" not in srv.stderr()


def test_api_key_guards_everything_but_health(tiny_target, tmp_path):
    env = {**__import__("os").environ, "SPECQ_API_KEY": "s3cret"}
    srv = ServerProc(["--target", str(tiny_target), "--threads", "1"], tmp_path / "s.log", env=env)
    try:
        assert http(f"{srv.url}/health")[0] == 200
        for path in ("/v1/models", "/metrics"):
            status, err = _error(http(f"{srv.url}{path}"))
            assert (status, err["code"]) == (401, "invalid_api_key")
        with pytest.raises(openai.AuthenticationError):
            client(srv.url, "wrong").completions.create(model="target", prompt="hi", max_tokens=4)
        r = client(srv.url, "s3cret").completions.create(model="target", prompt="The quick", max_tokens=4)
        assert r.usage.completion_tokens > 0
        assert http(f"{srv.url}/metrics", api_key="s3cret")[0] == 200
    finally:
        assert srv.stop() == 0


def test_a_full_queue_answers_503(tiny_target, tiny_close, tmp_path):
    srv = ServerProc(["--target", str(tiny_target), "--draft", str(tiny_close), *PAIR_ARGS, "--max-queue", "1"],
                     tmp_path / "s.log")
    statuses, retry_after = [], []

    def one(i):
        status, body = http(f"{srv.url}/v1/completions", {"prompt": PROMPTS[i], "max_tokens": 1500,
                                                          "temperature": 0}, timeout=CLIENT_TIMEOUT_S)
        statuses.append(status)
        if status == 503:
            retry_after.append(json.loads(body)["error"]["code"])

    try:
        with ThreadPoolExecutor(6) as pool:
            for f in [pool.submit(one, i) for i in range(6)]:
                f.result(timeout=CLIENT_TIMEOUT_S)
        m = srv.metrics()
    finally:
        assert srv.stop() == 0
    assert statuses.count(200) >= 2 and statuses.count(503) >= 1, statuses
    assert set(retry_after) == {"server_busy"}
    assert m["specq:requests_rejected_total"] == statuses.count(503)


def test_retry_after_header_on_503(tiny_target, tiny_close, tmp_path):
    srv = ServerProc(["--target", str(tiny_target), "--draft", str(tiny_close), *PAIR_ARGS, "--max-queue", "0"],
                     tmp_path / "s.log")
    try:
        c = client(srv.url)
        stream = c.completions.create(model="target", prompt=PROMPTS[0], max_tokens=2900, temperature=0, stream=True)
        next(iter(stream))  # the worker is busy with this one now
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(model="target", prompt=PROMPTS[1], max_tokens=4)
        stream.close()
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
    finally:
        assert srv.stop() == 0


# ---- the process ----------------------------------------------------------------------------------------
def test_port_in_use_is_one_line_and_exit_1(tiny_target):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = subprocess.run([SPECQ, "serve", "--target", str(tiny_target), "--port", str(port)], capture_output=True,
                           text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        f"specq: error: the port is in use (127.0.0.1:{port}); stop the other server or pass another --port"]


def test_sigterm_drains_the_running_stream_and_exits_0(tiny_target, tiny_close, tmp_path):
    srv = ServerProc(["--target", str(tiny_target), "--draft", str(tiny_close), *PAIR_ARGS], tmp_path / "s.log")
    try:
        stream = client(srv.url).completions.create(model="target", prompt=PROMPTS[0], max_tokens=300,
                                                    temperature=0, stream=True)
        it = iter(stream)
        first = next(it)
        srv.proc.send_signal(signal.SIGTERM)
        rest = list(it)  # the running request finishes: the server drains before it exits
        assert rest[-1].choices[0].finish_reason in ("stop", "length")
        assert len(first.choices[0].text + "".join(ch.choices[0].text for ch in rest)) > 0
        rc = srv.stop(timeout=60)
    finally:
        srv.stop(signal.SIGKILL)
    assert rc == 0
    assert "Traceback" not in srv.stderr() and "specq serve: stopped" in srv.stderr()


def test_sigint_exits_0(tiny_target, tmp_path):
    srv = ServerProc(["--target", str(tiny_target), "--threads", "1"], tmp_path / "s.log")
    assert srv.stop(signal.SIGINT) == 0
    assert "Traceback" not in srv.stderr()
