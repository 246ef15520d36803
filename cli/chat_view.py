"""What `specq chat` draws: pure functions from data to Rich renderables (no I/O here)."""

from __future__ import annotations

import unicodedata

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ..native.commands.chat import PanelData, Totals, Turn

DRAFT_STYLE = "green"
TARGET_STYLE = "yellow"


def sanitize(text: str) -> str:
    """Model output may hold control bytes that would drive the terminal; show them as U+FFFD."""
    return "".join(c if c in "\n\t" or unicodedata.category(c) != "Cc" else "\ufffd" for c in text)


class StreamBuffer:
    """The answer as coloured text: completed lines are handed out to print, the open line stays live."""

    def __init__(self, color: bool):
        self.color = color
        self.line = Text()

    def add(self, text: str, from_draft: bool) -> list[Text]:
        style = (DRAFT_STYLE if from_draft else TARGET_STYLE) if self.color else ""
        done = []
        parts = sanitize(text).split("\n")
        for i, part in enumerate(parts):
            if i:
                done.append(self.line)
                self.line = Text()
            if part:
                self.line.append(part, style=style)
        return done


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f}%"


def _num(v: float | None, spec: str = ".1f") -> str:
    return "–" if v is None else format(v, spec)


def build_panel(d: PanelData, color: bool = True) -> Panel:
    """The live dashboard below the answer."""
    g = Table.grid(padding=(0, 1))
    for _ in range(4):
        g.add_column()
    if d.speculative:
        g.add_row("accept", f"{_pct(d.answer_accept)} answer", f"{_pct(d.session_accept)} session",
                  f"tokens/step {_num(d.tokens_per_step, '.2f')}")
        g.add_row("α per pos", f"{_pct(d.answer_alpha)} answer", f"{_pct(d.session_alpha)} session", "")
        g.add_row("per step", f"draft {_num(d.draft_ms_step)} ms", f"verify {_num(d.verify_ms_step)} ms",
                  f"verify/draft {_num(d.verify_draft_ratio)}×")
    g.add_row("speed", f"{_num(d.window_tps)} tok/s (10 s)", f"tokens {d.n_generated}",
              f"ctx {d.ctx_used}/{d.n_ctx}")
    hint = Text(d.hint, style="dim" if color else "")
    title = f"{d.state} · k {d.draft_max} · p-min {d.p_min:g} · temp {d.temp:g}" if d.speculative else \
        f"{d.state} · temp {d.temp:g}"
    subtitle = None
    if color and d.speculative:
        subtitle = Text.assemble(("draft", DRAFT_STYLE), " / ", ("target", TARGET_STYLE))
    return Panel(Group(g, hint), title=title, title_align="left", subtitle=subtitle, subtitle_align="right",
                 expand=False, border_style="blue" if color else "")


def stats_table(totals: Totals, turns: list[Turn]) -> Table:
    """/stats: one row per answer and a session total."""
    t = Table(title="session", title_justify="left")
    for col in ("turn", "prompt", "tokens", "tok/s", "accept", "α", "acc/step", "stop"):
        t.add_column(col, justify="right" if col not in ("stop",) else "left")
    for i, tr in enumerate(turns, 1):
        st = tr.stats
        t.add_row(str(i), str(st.n_prompt), str(st.n_generated), _num(st.tokens_per_s), _pct(st.accept_rate),
                  _pct(st.alpha), _num(st.mean_accepted_per_step, ".2f"), st.stop_reason)
    t.add_row("all", str(totals.n_prompt), str(totals.n_generated), _num(totals.tokens_per_s),
              _pct(totals.accept_rate), _pct(totals.alpha), _num(totals.mean_accepted_per_step, ".2f"), "",
              style="bold")
    return t
