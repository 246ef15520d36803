"""`specq serve`'s pieces in-process: the wire format (pure), the stop-string matcher (pure), and the engine worker
on tiny models (prefix reuse, stop-string rollback, cancellation, errors)."""

from __future__ import annotations

import contextlib
import gc
import threading
import time

import pytest

pytest.importorskip("prometheus_client")

from beside import draft_memory
from specq.native.runtime.engine import Engine  # noqa: E402
from specq.native.core.settings import GenerationSettings  # noqa: E402
from specq.native.serving.api import ApiError, Limits, parse_json, parse_request, settings_for  # noqa: E402
from specq.native.serving.metrics import ServerMetrics  # noqa: E402
from specq.native.serving.request import Job, QueueFull, StopMatcher, reused_prefix  # noqa: E402
from specq.native.serving.scheduler import Scheduler, pick_session  # noqa: E402
from specq.native.core.memory import common_prefix  # noqa: E402

LIMITS = Limits(max_tokens=256, model_id="target", draft=True)
SETTINGS = GenerationSettings(n_predict=40, draft_max=4)


# ---- pure ---------------------------------------------------------------------------------------------
def feed_all(stops, pieces):
    m = StopMatcher(tuple(stops))
    out = []
    for p in pieces:
        out.append(m.feed(p))
        if m.hit:
            break
    return out, m


def test_stop_matcher_holds_back_a_possible_stop_and_cuts_at_it():
    out, m = feed_all(["END"], ["abc", "E", "N", "D", "more"])
    assert out == ["abc", "", "", ""] and m.hit and m.text == "abc"
    out, m = feed_all(["END"], ["abE", "Nx", "y"])
    assert out == ["ab", "ENx", "y"] and not m.hit  # a false start is released once it cannot match


def test_stop_matcher_earliest_stop_wins_and_flush_releases_the_tail():
    out, m = feed_all(["cd", "b"], ["abcd"])
    assert out == ["a"] and m.hit
    m = StopMatcher(("xyz",))
    assert m.feed("abx") == "ab" and m.flush() == "x"


def test_reused_prefix_leaves_the_last_prompt_token_to_decode():
    assert reused_prefix([1, 2, 3, 4], [1, 2, 3, 9]) == 3
    assert reused_prefix([1, 2, 3, 4], [1, 2]) == 1
    assert reused_prefix([], [5, 6]) == 0


def test_parse_request_maps_openai_names_and_keeps_server_defaults():
    req = parse_request({"prompt": "hi", "temperature": 0.5, "top_k": 7, "seed": -1, "draft_max": "auto",
                         "stop": "\n", "max_tokens": 12, "unknown_field": {"ignored": True}}, "completion", LIMITS)
    s = settings_for(req, GenerationSettings(p_min=0.3), seed=5)
    assert (s.temp, s.top_k, s.seed, s.draft_max, s.n_predict, s.p_min) == (0.5, 7, 0xFFFFFFFF, "auto", 12, 0.3)
    assert req.stops == ("\n",)
    assert settings_for(parse_request({"prompt": "x"}, "completion", LIMITS), SETTINGS, seed=5).seed == 5


@pytest.mark.parametrize("body, param", [
    ({"prompt": 3}, "prompt"), ({"prompt": "x", "top_p": 0}, "top_p"), ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": "x", "stream": "yes"}, "stream"), ({"prompt": "x", "drafter": "mtp"}, "drafter"),
    ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"), ({"prompt": "x", "echo": True}, "echo"),
])
def test_parse_request_names_the_bad_field(body, param):
    with pytest.raises(ApiError) as e:
        parse_request(body, "completion", LIMITS)
    assert e.value.status == 400 and e.value.param == param and param in e.value.message


def test_the_model_drafter_needs_a_draft_model():
    no_draft = Limits(max_tokens=256, model_id="target", draft=False)
    assert parse_request({"prompt": "x", "drafter": "ngram"}, "completion", no_draft).overrides["drafter"] == "ngram"
    with pytest.raises(ApiError, match="needs a draft model"):
        parse_request({"prompt": "x", "drafter": "model,ngram"}, "completion", no_draft)


def test_defaults_that_ask_for_nothing_are_accepted():
    parse_request({"prompt": "x", "n": 1, "logprobs": False, "tools": [], "frequency_penalty": 0,
                   "response_format": {"type": "text"}, "drafter": "model", "logit_bias": None, "best_of": None},
                  "completion", LIMITS)
    with pytest.raises(ApiError):
        parse_json(b"\xff\xfe")


# ---- the worker on tiny models ---------------------------------------------------------------------------
class Collector:
    """A job's emit: collects events; `done` is set by its last one."""

    def __init__(self):
        self.events, self.done = [], threading.Event()

    def __call__(self, item):
        self.events.append(item)
        if item[0] in ("done", "error"):
            self.done.set()

    def wait(self):
        assert self.done.wait(60), "the worker did not finish the job"
        kind, value = self.events[-1]
        return "".join(v for k, v in self.events if k == "text"), value


@contextlib.contextmanager
def running_worker(target, draft, ctx: int, max_queue: int, parallel: int = 1):
    """A Worker whose engine is loaded, driven and freed on one thread of its own, as the server's main thread does
    (llama.cpp's OpenMP thread team belongs to the thread that uses it)."""
    ready, box = threading.Event(), {}

    def own() -> None:
        try:
            eng = Engine(target, draft, ctx=ctx, threads=1, parallel=parallel)
            box["worker"] = Scheduler(eng, ServerMetrics(), max_queue)
        finally:
            ready.set()
        try:
            box["worker"].run()
        finally:
            eng.close()

    t = threading.Thread(target=own, name="engine-owner", daemon=True)
    t.start()
    assert ready.wait(120) and "worker" in box, "the engine did not load"
    try:
        yield box["worker"]
    finally:
        box["worker"].stop()
        t.join(120)


@pytest.fixture(scope="module")
def worker(tiny_target, tiny_close):
    with running_worker(tiny_target, tiny_close, 1024, 4) as w:
        yield w


def run_job(worker, prompt, settings=SETTINGS, stops=()):
    c = Collector()
    worker.submit(Job(list(prompt), settings, tuple(stops), c))
    return c.wait()


def test_the_shared_prefix_is_not_decoded_again(worker):
    eng = worker.engine
    base = eng.tokenize("def fibonacci(n):\n    if n < 2:")
    run_job(worker, base + eng.tokenize(" return"))
    decoded = []
    eng.tgt_ctx.on_decode = lambda name, n, pos0: decoded.append(n)
    try:
        text, out = run_job(worker, base + eng.tokenize(" print"))
    finally:
        eng.tgt_ctx.on_decode = None
    assert out.n_reused >= len(base) - 1 > 0
    # the prefill decoded only what follows the reused prefix (the first decode of the generation), the prompt's
    # last token with it (a lone request's first token comes from that decode: Session.take_ahead)
    assert decoded[0] == out.n_prompt - out.n_reused
    fresh = Engine(eng.target.path, eng.draft.path, ctx=1024, threads=1)
    try:
        ref = fresh.session().generate(base + eng.tokenize(" print"), SETTINGS, speculative=False).run()
    finally:
        fresh.close()
    assert text == ref.text and out.stats.n_drafted > 0


def settled(worker) -> None:
    """Wait (bounded) until the worker's loop has released every sequence: a job's "done" is sent from inside the
    step that ends it, before the loop has finished with its sequence."""
    for _ in range(1000):
        if len(worker.idle) == worker.n_slots and not worker.running:
            return
        time.sleep(0.01)
    raise AssertionError("the worker did not release its sequences")


def test_another_conversations_cached_turn_survives_a_new_request(tiny_target, tiny_close):
    """With idle sequences to choose from, a prompt that shares only a short start with a conversation's cached turn
    takes an empty sequence (scheduler.pick_session), and that conversation's next turn reuses its whole cache."""
    with running_worker(tiny_target, tiny_close, 512, 4, parallel=3) as w:
        eng = w.engine
        run_job(w, eng.tokenize("You are terse. def fibonacci(n):\n    if n < 2:"))
        settled(w)
        held = next(s for s in w.sessions if s.tgt.tokens)
        kept = list(held.tgt.tokens)
        other = eng.tokenize("You are terse. The quick brown fox")
        assert 0 < common_prefix(kept, other) < len(kept) // 2
        _, out_b = run_job(w, other)
        settled(w)
        assert held.tgt.tokens == kept and out_b.n_reused == 0  # it went to an empty sequence
        _, out = run_job(w, kept + eng.tokenize(" # next turn"))
        assert out.n_reused >= len(kept) - 1
        settled(w)


def test_pick_session_keeps_what_others_hold_unless_the_prompt_continues_it():
    from types import SimpleNamespace as NS

    def ses(tokens):
        return NS(tgt=NS(tokens=list(tokens)))

    convo, empty, short = ses(range(100)), ses([]), ses([0, 1, 2, 50])
    prompt = list(range(10)) + [999]  # shares 10 of convo's 100 and 3 of short's 4
    assert pick_session([convo, empty, short], prompt) is short  # keeps 3 of 4: at least KEEP_MIN
    assert pick_session([convo, empty], prompt) is empty  # would keep 10 of 100: an empty one loses nothing
    assert pick_session([convo, empty], list(range(120))) is convo  # its next turn
    other = ses(list(range(5)) + [7] * 30)  # shares 5, loses 30; convo shares 10, loses 90
    assert pick_session([convo, other], prompt) is other
    assert pick_session([ses([1] * 20), ses([0, 1] + [3] * 18)], prompt) is not None  # ties: any


def test_the_first_token_is_sent_before_the_draft_reads_the_prompt(worker, monkeypatch):
    """A served request's first token goes out before the draft model reads the prompt (off the path to it), as
    Generation.__iter__ does: the read comes after the step's text is sent, not between the step and the send."""
    from specq.native.runtime.session import Session

    order, real = [], Session.prefill_reader

    def read(self):
        got = real(self)
        order.append("read")
        return got

    monkeypatch.setattr(Session, "prefill_reader", read)
    c = Collector()

    def emit(item):
        order.append(item[0])
        c(item)

    eng = worker.engine
    worker.submit(Job(eng.tokenize("def fibonacci(n):\n    if n < 2:"), SETTINGS, (), emit, cache_prompt=False))
    _, out = c.wait()
    assert out.stats.n_drafted > 0 and "read" in order
    assert order.index("text") < order.index("read"), order


def test_a_stop_string_inside_a_step_rolls_both_caches_back(worker):
    eng, ses = worker.engine, worker.session
    prompt = eng.tokenize("The quick brown fox")
    full, _ = run_job(worker, prompt, GenerationSettings(n_predict=60, draft_max=4))
    for i in range(4, len(full) - 2):
        stop = full[i:i + 2]
        if "\ufffd" in stop or full.find(stop) != i:
            continue
        text, out = run_job(worker, prompt, GenerationSettings(n_predict=60, draft_max=4), stops=[stop])
        assert text == full[:i] and out.finish == "stop"
        if out.stats.n_generated > out.n_completion:  # the stop ended inside a multi-token step
            assert len(ses.history) == len(prompt) + out.n_completion
            kept = eng.target.detokenize(ses.history[len(prompt):])
            assert kept.startswith(full[:i]) and kept.endswith(stop)
            assert ses.tgt.tokens == ses.history[:-1] and draft_memory(ses).tokens == ses.history[:len(draft_memory(ses).tokens)]
            return
    pytest.fail("no stop string ended inside a multi-token step")


def test_a_cancelled_job_stops_within_a_step(worker):
    eng = worker.engine
    c = Collector()
    job = Job(eng.tokenize("for i in range(10):"), GenerationSettings(n_predict=500, draft_max=4), (), None)

    def emit(item):
        c(item)
        if item[0] == "text" and len(c.events) == 3:
            job.cancel()

    job.emit = emit
    cancelled = lambda: worker.metrics.registry.get_sample_value("specq:requests_cancelled_total")  # noqa: E731
    before = cancelled()
    worker.submit(job)
    _, out = c.wait()
    assert out.finish == "interrupted" and out.n_completion <= 3 * (4 + 1)
    assert cancelled() == before + 1
    ses = worker.session  # the target holds all but the last token; the draft a prefix (it catches up)
    assert ses.tgt.tokens == ses.history[:-1] and draft_memory(ses).tokens == ses.history[:len(draft_memory(ses).tokens)]


def test_the_queue_is_bounded(tiny_target):
    gate = threading.Event()
    first = Collector()

    def slow_emit(item):  # holds the worker until the test has tried a second job
        gate.wait(30)
        first(item)

    with running_worker(tiny_target, None, 256, 0) as w:
        eng = w.engine
        try:
            w.submit(Job(eng.tokenize("The quick"), GenerationSettings(n_predict=4), (), slow_emit))
            with pytest.raises(QueueFull) as e:
                w.submit(Job(eng.tokenize("The quick"), GenerationSettings(n_predict=4), (), Collector()))
            assert e.value.status == 503 and e.value.headers == {"Retry-After": "1"}
        finally:
            gate.set()
            first.wait()


# ---- set-up errors and warnings ----------------------------------------------------------------------------
def test_a_missing_serve_extra_is_one_actionable_error(monkeypatch):
    from specq.errors import SpecqError
    from specq.native.serving import app as serve

    real = serve.importlib.util.find_spec
    monkeypatch.setattr(serve.importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    with pytest.raises(SpecqError, match=r"\(uvicorn not installed\); run `pip install 'specq\[serve\]'`"):
        serve.require_serve_extra()


def test_listening_beyond_loopback_warns_loudest_without_a_key():
    from specq.cli.serve import _exposure_warning

    assert _exposure_warning("127.0.0.1", None) is None and _exposure_warning("::1", None) is None
    assert _exposure_warning("localhost", None) is None
    assert "WITHOUT an API key" in _exposure_warning("0.0.0.0", None)
    assert "anyone who can reach this machine" in _exposure_warning("0.0.0.0", "k")


# ---- the thread that computes ----------------------------------------------------------------------------
# What computes on the models (load, warm-up, decode, logits, memory and state, sampling, free); tokenizing and
# detokenizing only read the vocabulary and may run anywhere.
COMPUTE = {"Model": ("__init__", "close"),
           "Context": ("__init__", "warm_up", "decode", "decode_seqs", "logits", "seq_rm", "clear", "state_get",
                       "state_set", "close"),
           "Sampler": ("__init__", "sample", "close"), "TransformChain": ("__init__", "apply", "close")}


@pytest.mark.parametrize("parallel", [1, 3])
def test_a_served_request_computes_only_on_the_thread_that_loaded_the_models(tiny_target, tiny_close, monkeypatch,
                                                                             parallel):
    """llama.cpp's CPU backend runs GNU OpenMP, whose thread team belongs to the calling thread: an engine driven
    from another thread than the one that loaded it decoded ~0.65x as fast. The real server, in-process, with
    every compute entry point of the FFI boundary recording its thread."""
    import json

    from serve_proc import serve_in_process
    from specq.native.llama import ffi as _ffi
    from specq.native.runtime.config import EngineConfig

    calls: list[tuple[str, int]] = []

    def recorded(name, real):
        def call(*a, **kw):
            if not name.endswith(".close") or a[0]._h is not None:  # (a handle already freed frees nothing)
                calls.append((name, threading.get_ident()))
            return real(*a, **kw)
        return call

    gc.collect()  # an earlier test's engine, garbage now, is not closed by whichever thread collects it here

    for cls, names in COMPUTE.items():
        for name in names:
            monkeypatch.setattr(getattr(_ffi, cls), name, recorded(f"{cls}.{name}", getattr(getattr(_ffi, cls), name)))

    answers = serve_in_process(EngineConfig(str(tiny_target), str(tiny_close), ctx=1024, threads=1, parallel=parallel),
                               [{"prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0},
                                {"prompt": "def fibonacci(n):", "max_tokens": 24, "temperature": 0.8, "seed": 3,
                                 "stream": True},
                                {"prompt": "def fibonacci(n):", "max_tokens": 24, "temperature": 0.8, "seed": 3,
                                 "accept": "match"}], SETTINGS, concurrent=parallel > 1)
    assert [status for status, _ in answers] == [200, 200, 200], answers
    assert json.loads(answers[0][1])["usage"]["speculative"]["n_drafted"] > 0
    loader = {t for name, t in calls if name == "Model.__init__"}
    assert len(loader) == 1
    elsewhere = sorted({name for name, t in calls if t not in loader})
    assert not elsewhere, f"llama.cpp computed on another thread than the loader's: {elsewhere}"
    assert {"Context.decode", "Sampler.sample", "TransformChain.apply", "Context.close"} <= {n for n, _ in calls}
    if parallel > 1:
        assert "Context.decode_seqs" in {n for n, _ in calls}  # the requests ran together


def test_a_reader_too_far_behind_loses_its_generation_instead_of_buffering_without_bound():
    import asyncio

    from specq.native.serving.outbox import MAX_BUFFERED, Outbox, emitter

    async def main():
        events: asyncio.Queue = asyncio.Queue()
        overflowed = []
        emit = emitter(Outbox(asyncio.get_running_loop()), events, on_overflow=lambda: overflowed.append(1))
        for i in range(MAX_BUFFERED + 10):  # nobody reads
            emit(("text", "x"))
        emit(("done", None))
        await asyncio.sleep(0.05)
        return events.qsize(), len(overflowed)

    size, overflowed = asyncio.run(main())
    assert size == MAX_BUFFERED + 1 and overflowed == 10  # the end still arrives; the overflow cancelled the job


def test_a_steps_events_reach_the_loop_in_order_with_one_wake_up():
    import asyncio
    import threading
    import time

    from specq.native.serving.outbox import Outbox, emitter

    async def main():
        box = Outbox(asyncio.get_running_loop())
        queues = [asyncio.Queue() for _ in range(4)]
        emits = [emitter(box, q) for q in queues]

        def step():  # a step of four sequences, three events each, sent from another thread
            with box.held():
                for i in range(3):
                    for k, emit in enumerate(emits):
                        emit(("text", f"{k}:{i}"))
                    time.sleep(0.02)  # time for the loop to run, were it woken

        async def on_thread(fn):
            t = threading.Thread(target=fn)
            t.start()
            await asyncio.to_thread(t.join)
            for _ in range(100):
                await asyncio.sleep(0.01)
                if not box._calls:
                    return

        await on_thread(step)
        wakeups = [box.n_wakeups]
        await on_thread(lambda: emits[0](("done", None)))  # outside a step: at once
        wakeups.append(box.n_wakeups)
        return [[q.get_nowait()[1] for _ in range(q.qsize())] for q in queues], box.n_sent, wakeups

    got, sent, wakeups = asyncio.run(main())
    assert got[0] == ["0:0", "0:1", "0:2", None] and got[3] == ["3:0", "3:1", "3:2"]
    assert sent == 13 and wakeups == [1, 2]  # the held step's twelve events at once, then the lone one
