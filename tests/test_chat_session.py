"""The chat library: template rendering, multi-turn reuse of the caches, slash commands, live statistics."""

from __future__ import annotations

import json

import pytest

from specq.errors import ContextFullError, SpecqError, UsageError
from specq.native.commands.chat import (AnswerProgress, ChatSession, Command, RateWindow, Totals, apply_setting,
                                        health_hint, panel_data, parse_command, reusable_prefix)
from specq.native.runtime.engine import Engine
from specq.native.core.settings import GenerationSettings
from specq.native.core.stats import TokenEvent
from specq.native.core.template import load_template

SETTINGS = GenerationSettings(n_predict=12, draft_max=4)


@pytest.fixture(scope="module")
def engine(tiny_target, tiny_close):
    with Engine(tiny_target, tiny_close, ctx=512, threads=1) as e:
        yield e


def chat_of(engine, **kw) -> ChatSession:
    return ChatSession(engine, engine.target.chat_template(), kw.pop("settings", SETTINGS), **kw)


def run(answer):
    for _ in answer:
        pass
    answer.close()
    return answer


# ---- pure pieces ---------------------------------------------------------------------------------
def test_parse_command():
    assert parse_command("hello /k 3") is None
    assert parse_command("//not a command") is None
    assert parse_command(" /k 4 ") == Command("k", "4")
    assert parse_command("/system Be brief.") == Command("system", "Be brief.")
    assert parse_command("/exit") == Command("quit")
    with pytest.raises(UsageError, match="/frobnicate"):
        parse_command("/frobnicate")


def test_apply_setting():
    s = GenerationSettings(draft_max=8, draft_min=6)
    assert apply_setting(s, Command("k", "4")).draft_max == 4
    assert apply_setting(s, Command("k", "4")).draft_min == 4  # kept valid
    assert apply_setting(s, Command("pmin", "0.5")).p_min == 0.5
    assert apply_setting(s, Command("temp", "0.7")).temp == 0.7
    assert apply_setting(s, Command("n", "32")).n_predict == 32
    assert apply_setting(s, Command("n", "off")).n_predict is None
    with pytest.raises(UsageError, match="/k needs a number"):
        apply_setting(s, Command("k", "many"))
    with pytest.raises(UsageError, match="--draft-max"):
        apply_setting(s, Command("k", "0"))
    with pytest.raises(UsageError, match="--p-min"):
        apply_setting(s, Command("pmin", "2"))


def test_reusable_prefix_stops_at_mismatch_and_character_boundaries():
    rendered = "ab你好cd".encode()
    assert reusable_prefix([b"a", b"b"], rendered) == 2
    assert reusable_prefix([b"a", b"x"], rendered) == 1
    ni = "你".encode()
    # a token ending inside a UTF-8 character cannot be a cut point
    assert reusable_prefix([b"ab", ni[:2]], rendered) == 1
    assert reusable_prefix([b"ab", ni[:2], ni[2:]], rendered) == 3
    assert reusable_prefix([], rendered) == 0


def test_load_template():
    assert load_template(None, "{{ x }}") == "{{ x }}"
    assert load_template("{% for m in messages %}{% endfor %}", "{{ x }}").startswith("{% for")
    with pytest.raises(SpecqError, match="no chat template .*--template"):
        load_template(None, None, "m.gguf")
    with pytest.raises(UsageError, match="neither a file nor a Jinja template"):
        load_template("chatml-ish", None)


def test_rate_window_forgets_old_tokens():
    w = RateWindow(10.0)
    w.start(0.0)
    for t in range(0, 20):
        w.add(float(t), 10 if t < 10 else 1)
    assert w.rate(20.0) == pytest.approx(10 / 10.0)  # only the last 10 s count
    w2 = RateWindow(10.0)
    w2.start(0.0)
    w2.add(1.0, 5)
    assert w2.rate(2.0) == pytest.approx(5 / 2.0)  # young answers: divide by the time so far
    assert RateWindow().rate(1.0) is None


def test_health_hint():
    assert health_hint(None, None, None, None).startswith("no draft statistics")
    assert health_hint(0.1, 1.1, 2.0, 10.0).startswith("draft too weak")
    assert health_hint(0.8, 2.0, 30.0, 10.0).startswith("draft too slow for its acceptance")
    assert health_hint(0.9, 5.0, 5.0, 10.0).startswith("healthy")


def test_panel_data_from_events_then_stats(engine):
    chat = chat_of(engine)
    p = AnswerProgress(started=0.0)
    for i in range(6):
        p.add(TokenEvent(5, "x", i % 3 != 2, i // 3), now=0.1 * (i + 1))
    d = panel_data(p, Totals(), 40, 512, chat.settings, True, now=1.0)
    assert d.state == "generating" and d.n_generated == 6 and d.tokens_per_step == 3.0
    assert d.from_draft == pytest.approx(4 / 6) and d.answer_accept is None
    assert d.window_tps == pytest.approx(6.0)
    ans = run(chat.ask("hello"))
    p.stats = ans.stats
    d = panel_data(p, chat.totals, chat.n_used, chat.n_ctx, chat.settings, True, now=1.0)
    assert d.answer_accept == ans.stats.accept_rate and d.session_accept == chat.totals.accept_rate
    assert d.verify_ms_step == pytest.approx(ans.stats.verify_ms / ans.stats.n_steps)
    assert d.state == "done (n-predict)" and d.ctx_used == len(chat.session.history)


# ---- on the tiny models ------------------------------------------------------------------------------
def test_two_turns_prefill_only_the_new_suffix_and_answer_like_the_target_alone(engine, tiny_target):
    chat = chat_of(engine, system="You are terse.")
    a1 = run(chat.ask("def fibonacci(n):"))
    held = list(chat.session.history)
    assert a1.turn.n_reused == 0 and a1.stats.n_prompt == len(a1.turn.prompt_tokens)
    a2 = run(chat.ask("The quick brown fox"))
    # Turn 2 reuses everything turn 1 left in the caches and prefills only the text after it.
    assert a2.turn.n_reused == len(held)
    r2 = chat.formatter.render(chat.conversation()[:-1]).encode("utf-8", "surrogateescape")
    held_bytes = b"".join(engine.target.piece(t) for t in held)
    assert r2.startswith(held_bytes)
    suffix = engine.target.tokenize(r2[len(held_bytes):].decode(), add_special=False)
    assert a2.stats.n_prompt == len(suffix) == len(a2.turn.prompt_tokens)
    assert a2.stats.n_prompt < len(engine.target.tokenize(r2.decode("utf-8", "replace"), add_special=False)) // 2
    # Exactness across turns: the same history from scratch, target alone, gives the same answer.
    with Engine(tiny_target, None, ctx=512, threads=1) as alone:
        prefix = chat.session.history[:len(chat.session.history) - len(a2.turn.tokens)]
        ref = alone.session().generate(prefix, SETTINGS, speculative=False).run()
    assert a2.turn.tokens == ref.tokens
    assert chat.totals.turns == 2 and chat.totals.n_generated == a1.stats.n_generated + a2.stats.n_generated


def test_changed_system_prompt_falls_back_to_the_common_prefix(engine):
    chat = chat_of(engine, system="A")
    run(chat.ask("hello"))
    n_held = len(chat.session.history)
    chat.set_system("B, a different system prompt")
    a = run(chat.ask("again"))
    assert a.turn.n_reused < n_held
    assert a.turn.n_reused == len(engine.target.tokenize("<|im_start|>system\n", add_special=False))


def test_stopping_early_keeps_the_caches_consistent(engine, tiny_target):
    chat = chat_of(engine, settings=GenerationSettings(n_predict=None, draft_max=4))
    ans = chat.ask("hello")
    for i, _ in enumerate(ans):
        if i == 7:
            break
    ans.close()
    assert ans.stats.stop_reason == "interrupted" and len(ans.turn.tokens) >= 8
    assert chat.session.tgt.tokens == chat.session.history[:-1]
    chat.settings = SETTINGS
    a2 = run(chat.ask("next"))
    with Engine(tiny_target, None, ctx=512, threads=1) as alone:
        prefix = chat.session.history[:len(chat.session.history) - len(a2.turn.tokens)]
        ref = alone.session().generate(prefix, SETTINGS, speculative=False).run()
    assert a2.turn.tokens == ref.tokens


def test_full_context_says_reset(tiny_target, tiny_close):
    with Engine(tiny_target, tiny_close, ctx=64, threads=1) as e:
        chat = chat_of(e, settings=GenerationSettings(n_predict=None, draft_max=4))
        a = run(chat.ask("hello"))
        assert a.stats.stop_reason == "ctx"
        with pytest.raises(ContextFullError, match="/reset"):
            chat.ask("more")
        chat.reset()
        assert run(chat.ask("hello")).stats.n_generated > 0


def test_save_writes_transcript_and_stats(engine, tmp_path):
    chat = chat_of(engine)
    run(chat.ask("hello"))
    out = chat.save(tmp_path / "t.json")
    doc = json.loads(out.read_text())
    assert [m["role"] for m in doc["messages"]] == ["user", "assistant"]
    assert doc["turns"][0]["n_generated"] == 12 and doc["turns"][0]["accept_rate"] is not None
    assert doc["history"] == chat.session.history
    assert set(doc["totals"]) >= {"turns", "n_generated", "accept_rate", "tokens_per_s"}
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]  # no temporary left behind
    with pytest.raises(UsageError, match="folder not found"):
        chat.save(tmp_path / "missing" / "t.json")


def test_panel_shows_this_answers_acceptance_while_it_streams(engine):
    chat = chat_of(engine)
    ans = chat.ask("hello there")
    p = AnswerProgress(started=0.0)
    it = iter(ans)
    for _ in range(12):
        p.add(next(it), now=0.5)
    p.live = ans.snapshot()
    d = panel_data(p, chat.totals, chat.n_used, chat.n_ctx, chat.settings, True, now=1.0)
    assert d.state == "generating"
    assert p.live.n_drafted > 0 and d.answer_accept == p.live.accept_rate  # known before the answer ends
    assert d.draft_ms_step == pytest.approx(p.live.draft_ms / p.live.n_steps)
    ans.close()
