"""`specq chat` in-process: rendering with a fake engine (canned events and stats), piped mode on tiny models."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

import specq.cli.chat as chat_cli
from specq.cli.chat_view import StreamBuffer, build_panel, sanitize, stats_table
from specq.cli.main import app
from specq.native.commands.chat import ChatSession, PanelData
from specq.native.core.settings import GenerationSettings
from specq.native.core.stats import GenerationStats, TokenEvent

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
FINAL_KEYS = {"turns", "n_generated", "accept_rate", "alpha", "mean_accepted_per_step", "tokens_per_s"}
runner = CliRunner()


# ---- a fake engine: one token per character, canned answers ------------------------------------
class FakeTarget:
    path = Path("fake-target.gguf")
    bos, eos, add_bos = -1, 0, False

    def chat_template(self):
        return CHATML

    def token_text(self, t):
        return b"<eos>"

    def tokenize(self, text, add_special=True, parse_special=True):
        return [ord(c) for c in text]

    def piece(self, t):
        return b"" if t == 0 else chr(t).encode()

    def is_eog(self, t):
        return t == 0


@dataclass
class FakeGeneration:
    session: "FakeSession"
    new: list[int]
    answer: str
    stats: GenerationStats | None = None
    tokens: list[int] = field(default_factory=list)

    def __iter__(self):
        self.session.history.extend(self.new)
        try:
            for i, ch in enumerate(self.answer):
                self.session.history.append(ord(ch))
                self.tokens.append(ord(ch))
                yield TokenEvent(ord(ch), ch, from_draft=i % 4 != 3, step=i // 4)
            self.tokens.append(0)
            self.session.history.append(0)
            yield TokenEvent(0, "", False, len(self.answer) // 4)
        finally:
            n = len(self.tokens)
            steps = (n + 3) // 4
            self.stats = GenerationStats(
                speculative=True, n_prompt=len(self.new), n_generated=n, n_steps=steps, n_drafted=4 * steps,
                n_accepted=n - steps, accepted_per_pos=(steps,) * 3, prompt_ms=1.0, draft_ms=2.0 * steps,
                verify_ms=8.0 * steps, gen_ms=10.0 * steps, decode_ms=9.0 * steps, n_restores=0, stop_reason="eog")


class FakeSession:
    def __init__(self, answers):
        self.history, self.answers = [], answers

    def reset(self):
        self.history = []

    def generate(self, new, settings, speculative=True):
        return FakeGeneration(self, list(new), self.answers.pop(0))


class FakeEngine:
    n_ctx = 4096

    def __init__(self, answers):
        self.target, self.draft, self.answers = FakeTarget(), FakeTarget(), answers
        self.closed = False

    def session(self):
        return FakeSession(self.answers)

    def close(self):
        self.closed = True


@pytest.fixture
def fake(monkeypatch):
    eng = FakeEngine(["Hello there!\nSecond line.", "Fine, thanks."])

    def open_chat(engine, *, template, settings, system):
        return ChatSession(eng, template or eng.target.chat_template(), settings, system)

    monkeypatch.setattr(chat_cli, "open_chat", open_chat)
    return eng


def test_piped_with_fake_engine_prints_answers_and_one_final_stats_line(fake, tmp_path):
    save = tmp_path / "t.json"
    r = runner.invoke(app, ["chat", "--target", "x.gguf", "--draft", "y.gguf", "--system", "Be kind."],
                      input=f"hi\n\n/k 3\nhow are you?\n/save {save}\n/quit\nnot reached\n")
    assert r.exit_code == 0, r.output
    assert r.stdout == "Hello there!\nSecond line.\nFine, thanks.\n"
    last = r.stderr.strip().splitlines()[-1]
    doc = json.loads(last)
    assert set(doc) == FINAL_KEYS
    assert doc["turns"] == 2 and doc["n_generated"] == 26 + 14
    assert "draft-max 3" in r.stderr and "saved to" in r.stderr
    saved = json.loads(save.read_text())
    assert saved["settings"]["draft_max"] == 3
    assert [m["role"] for m in saved["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    # turn 2 prefilled only its own text (one fake token per character): the rendering after the history
    assert saved["turns"][1]["n_prompt"] == len("<|im_end|>\n<|im_start|>user\nhow are you?<|im_end|>\n"
                                                "<|im_start|>assistant\n")
    assert saved["turns"][1]["n_reused"] == len(saved["history"]) - saved["turns"][1]["n_prompt"] - 14
    assert fake.closed


def test_piped_bad_command_is_reported_and_exit_1(fake):
    r = runner.invoke(app, ["chat", "--target", "x.gguf", "--draft", "y.gguf"], input="/k zero\nhi\n")
    assert r.exit_code == 1
    assert "specq: error: /k needs a number" in r.stderr
    assert json.loads(r.stderr.strip().splitlines()[-1])["turns"] == 1


def panel_text(d: PanelData, width: int = 80) -> str:
    c = Console(width=width, record=True, color_system=None)
    c.print(build_panel(d, color=False))
    return c.export_text()


def test_panel_is_built_from_data_and_fits_80_columns():
    d = PanelData(state="generating", answer_accept=0.75, session_accept=0.5, answer_alpha=0.8, session_alpha=0.625,
                  tokens_per_step=3.25,
                  draft_ms_step=2.0, verify_ms_step=8.0, verify_draft_ratio=4.0, hint="healthy: about 2.6×",
                  window_tps=123.4, n_generated=42, session_generated=100, from_draft=0.7, ctx_used=300,
                  n_ctx=4096, draft_max=8, p_min=0.0, temp=0.0, speculative=True)
    text = panel_text(d)
    for frag in ("generating · k 8", "75.0% answer", "50.0% session", "80.0% answer", "62.5% session",
                 "tokens/step 3.25", "draft 2.0 ms",
                 "verify 8.0 ms", "verify/draft 4.0×", "123.4 tok/s (10 s)", "tokens 42", "ctx 300/4096",
                 "healthy"):
        assert frag in text, frag
    assert max(len(ln) for ln in text.splitlines()) <= 80
    alone = panel_text(PanelData(**{**d.__dict__, "speculative": False, "hint": "target alone (no draft)"}))
    assert "accept" not in alone and "α" not in alone and "target alone" in alone


def test_stream_buffer_colours_draft_and_target_tokens():
    b = StreamBuffer(color=True)
    assert b.add("ab", True) == []
    done = b.add("c\nd", False)
    assert [t.plain for t in done] == ["abc"]
    assert b.line.plain == "d"
    styles = {str(s.style) for s in done[0].spans}
    assert styles == {"green", "yellow"}
    plain = StreamBuffer(color=False)
    plain.add("xy", True)
    assert not plain.line.spans
    assert sanitize("a\x1b[2Jb\tc\n") == "a\ufffd[2Jb\tc\n"


def test_stats_table_lists_turns_and_total(fake):
    chat = ChatSession(fake, CHATML, GenerationSettings(n_predict=None))
    for q in ("a", "b"):
        ans = chat.ask(q)
        for _ in ans:
            pass
        ans.close()
    c = Console(width=80, record=True, color_system=None)
    c.print(stats_table(chat.totals, chat.turns))
    text = c.export_text()
    assert re.search(r"1 │\s+\d+ │\s+26 │.*eog", text)  # 25 characters and the end-of-generation token
    assert re.search(r"all │\s+\d+ │\s+40 │", text)


# ---- on the tiny models, piped ------------------------------------------------------------------------
def test_piped_two_turns_on_tiny_models(tiny_target, tiny_close):
    # a fixed draft length: on models this tiny, the default (auto) rightly finds that drafting does not pay
    r = runner.invoke(app, ["chat", "--target", str(tiny_target), "--draft", str(tiny_close), "--ctx", "512",
                            "--threads", "1", "--n-predict", "16", "--draft-max", "4", "-v"],
                      input="def fibonacci(n):\nThe quick brown fox\n")
    assert r.exit_code == 0, r.output
    turns = [tuple(map(int, m)) for m in re.findall(r"turn \d: prefilling (\d+) new tokens \(reusing (\d+)\)",
                                                      r.stderr)]
    assert len(turns) == 2
    (new1, reused1), (new2, reused2) = turns
    assert reused1 == 0 and reused2 == new1 + 16  # turn 1's prompt and its 16-token answer stay cached
    assert 0 < new2 < new1 + 16
    doc = json.loads(r.stderr.strip().splitlines()[-1])
    assert set(doc) == FINAL_KEYS and doc["turns"] == 2 and doc["n_generated"] == 32
    assert 0 < doc["accept_rate"] <= 1 and doc["tokens_per_s"] > 0
    assert len(r.stdout.splitlines()) >= 2


def test_template_option_and_errors(tiny_target, tiny_close, tmp_path):
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] ")
    base = ["chat", "--target", str(tiny_target), "--draft", str(tiny_close), "--ctx", "256", "--threads", "1",
            "--n-predict", "4"]
    r = runner.invoke(app, base + ["--template", str(tpl)], input="hi\n")
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, base + ["--template", "not-a-template"], input="hi\n")
    assert r.exit_code == 2 and r.stderr.strip().splitlines() == [
        "specq: error: --template is neither a file nor a Jinja template (not-a-template); "
        "pass a template file or the template text"]
    r = runner.invoke(app, base + ["--template", "{% for m in messages %}"], input="hi\n")
    assert r.exit_code == 1 and "does not parse" in r.stderr and "Traceback" not in r.output
    r = runner.invoke(app, base + ["--draft-max", "0"], input="hi\n")
    assert r.exit_code == 2 and "--draft-max" in r.stderr
