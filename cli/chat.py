"""`specq chat`: a speculative chat with a live dashboard; piped stdin makes it scriptable."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Optional, TextIO

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from ..errors import ContextFullError, UsageError
from ..native.commands.chat import (HELP, AnswerProgress, ChatSession, Command, ConversationFullError, apply_setting,
                                    open_chat, panel_data, parse_command)
from ._common import (draft_for_drafters, engine_config, ENGINE_FLAGS, Flags, GENERATION_FLAGS, handle_errors,
                      models_or_demo, Quiet, resolve_pair, settings_from_flags, setup_logging, shared_flags, Verbose,
                      warn)
from .checks import pair_warning, user_path
from .chat_view import StreamBuffer, build_panel, stats_table

REFRESH_S = 1 / 15  # the panel redraws at most this often; the tokens themselves are printed as they come


def run_command(chat: ChatSession, cmd: Command):
    """Apply one slash command; returns (what to show, whether to quit). UsageError on a bad argument."""
    if cmd.name == "quit":
        return None, True
    if cmd.name == "help":
        return HELP, False
    if cmd.name == "reset":
        chat.reset()
        return "conversation cleared (both caches emptied)", False
    if cmd.name == "stats":
        return stats_table(chat.totals, chat.turns), False
    if cmd.name in ("k", "pmin", "temp", "n"):
        try:
            chat.settings = apply_setting(chat.settings, cmd)
        except UsageError as e:
            raise UsageError(as_command(str(e)))
        s = chat.settings
        return (f"draft-max {s.draft_max} · p-min {s.p_min:g} · temp {s.temp:g} · "
                f"n-predict {s.n_predict if s.n_predict is not None else 'no limit'}"), False
    if cmd.name == "system":
        chat.set_system(cmd.arg)
        return ("system prompt set" if cmd.arg else "system prompt removed") + \
            "; the conversation is re-read on the next turn", False
    if cmd.name == "save":
        if not cmd.arg:
            raise UsageError("/save needs a file name (nothing given); e.g. /save chat.json")
        if Path(cmd.arg).expanduser().is_dir():
            raise UsageError(f"/save needs a file name, not a folder ({cmd.arg}); e.g. /save {Path(cmd.arg) / 'chat.json'}")
        return f"saved to {chat.save(Path(cmd.arg).expanduser())}", False
    raise UsageError(f"unknown command (/{cmd.name}); type /help for the list")


# In a chat the settings are slash commands: a message about a flag names the command instead.
_COMMAND_OF_FLAG = {"--draft-max": "/k", "--p-min": "/pmin", "--temp": "/temp", "--n-predict": "/n"}


def as_command(message: str) -> str:
    for flag, command in _COMMAND_OF_FLAG.items():
        message = message.replace(flag, command)
    return message


def error_line(message) -> str:
    return f"specq: error: {message}"


def os_error_line(e: OSError) -> str:
    return error_line(f"{e.strerror or e} ({user_path(e.filename)}); check the path and permissions")


def full_line(e: ContextFullError, interactive: bool) -> str:
    """The one line for a turn that does not fit; /reset is offered only where it can be typed and helps."""
    if isinstance(e, ConversationFullError) and not e.first_turn and not interactive:
        return error_line(f"the conversation is full ({e.n_tokens} tokens, ctx {e.n_ctx}); use a larger --ctx")
    return error_line(e)


def answer_full_line(chat: ChatSession, interactive: bool) -> str:
    fix = "type /reset to start a new conversation, or use a larger --ctx" if interactive else "use a larger --ctx"
    return error_line(f"the context is full ({chat.n_used} of {chat.n_ctx} tokens); {fix}")


class _StopOnCtrlC:
    """During an answer, the first Ctrl-C asks the loop to stop after the current step; a second one raises."""

    def __enter__(self):
        self.requested = False
        self._old = None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


def stream_answer(chat: ChatSession, text: str, console: Console, color: bool, panel: bool) -> None:
    """Stream one answer above the live panel; Ctrl-C ends it early with both caches consistent."""
    try:
        answer = chat.ask(text)
    except ContextFullError as e:
        console.print(full_line(e, interactive=True), style="red" if color else "", soft_wrap=True)
        return
    prog = AnswerProgress(started=time.perf_counter())
    buf = StreamBuffer(color)

    def view(now: float):
        if not panel:
            return buf.line
        d = panel_data(prog, chat.totals, chat.n_used, chat.n_ctx, chat.settings, chat.speculative, now)
        return Group(buf.line, build_panel(d, color))

    last = 0.0
    with _StopOnCtrlC() as stop, Live(view(prog.started), console=console, auto_refresh=False) as live:
        try:
            for ev in answer:
                now = time.perf_counter()
                prog.add(ev, now)
                for line in buf.add(ev.text, ev.from_draft):
                    live.console.print(line)
                if stop.requested:
                    break
                if now - last >= REFRESH_S:
                    prog.live = answer.snapshot()
                    live.update(view(now), refresh=True)
                    last = now
        except KeyboardInterrupt:
            pass  # a second Ctrl-C while a step was running: the engine has already rewound
        finally:
            answer.close()
            prog.stats = answer.stats
            live.update(view(time.perf_counter()), refresh=True)
    reason = answer.stats.stop_reason if answer.stats else "interrupted"
    if reason == "interrupted":
        console.print("(interrupted; both caches are consistent, the conversation goes on)", style="dim")
    elif reason == "ctx":
        console.print(answer_full_line(chat, interactive=True), style="red" if color else "", soft_wrap=True)


def interactive(chat: ChatSession, console: Console, color: bool, panel: bool, banner: str) -> int:
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    console.print(banner, style="dim")
    while True:
        try:
            line = console.input(Text("> ", style="bold") if color else "> ")
        except EOFError:
            console.print()
            return 0
        if not line.strip():
            continue
        try:
            cmd = parse_command(line)
            if cmd is None:
                stream_answer(chat, line, console, color, panel)
                continue
            shown, quit_ = run_command(chat, cmd)
        except UsageError as e:
            console.print(error_line(e), style="red" if color else "", soft_wrap=True)
            continue
        except OSError as e:
            console.print(os_error_line(e), style="red" if color else "", soft_wrap=True)
            continue
        if quit_:
            return 0
        if shown is not None:
            console.print(shown)


def piped(chat: ChatSession, lines: TextIO, stdout: TextIO, stderr: Console) -> int:
    """Each line a user turn (or a slash command); answers on stdout. The caller prints the stats line."""
    failed = False
    for line in lines:
        line = line.rstrip("\r\n")
        if not line.strip():
            continue
        try:
            cmd = parse_command(line)
            if cmd is not None:
                shown, quit_ = run_command(chat, cmd)
                if quit_:
                    break
                if shown is not None:
                    stderr.print(shown)
                continue
            answer = chat.ask(line)
        except UsageError as e:
            stderr.print(error_line(e))
            failed = True
            continue
        except ContextFullError as e:
            stderr.print(full_line(e, interactive=False))
            failed = True
            continue
        except OSError as e:  # /save to a bad path: the session goes on
            stderr.print(os_error_line(e))
            failed = True
            continue
        try:
            for ev in answer:
                stdout.write(ev.text)
                stdout.flush()
        finally:
            answer.close()
        stdout.write("\n")
        stdout.flush()
        if answer.stats.stop_reason == "ctx":  # the answer was cut: a script must not take it as whole
            stderr.print(answer_full_line(chat, interactive=False))
            failed = True
    return 1 if failed else 0


@handle_errors
@shared_flags("pair", "target", *GENERATION_FLAGS, *ENGINE_FLAGS)
def main(
    click_ctx: typer.Context,
    draft: Annotated[Optional[Path], typer.Option(help="Draft GGUF; without it the target runs alone.")] = None,
    system: Annotated[Optional[str], typer.Option(help="System prompt.")] = None,
    template: Annotated[Optional[str], typer.Option(help="Chat template (a Jinja file or text) when the model "
                                                          "has none or to override its own.")] = None,
    n_predict: Annotated[Optional[int], typer.Option(help="Most tokens per answer (default: until the end of "
                                                           "generation or a full context).")] = None,
    no_color: Annotated[bool, typer.Option("--no-color", help="No colours (draft and target tokens look alike).")] = False,
    verbose: Verbose = False,
    quiet: Quiet = False,
    *,
    flags: Flags,
) -> None:
    f = flags
    setup_logging(verbose, quiet)
    target, draft, suggested = resolve_pair(f.pair, f.target, draft, click_ctx)
    ctx = suggested.get("ctx", f.ctx)
    settings = settings_from_flags(suggested, f, n_predict=n_predict)
    if f.threads is not None and f.threads < 1:
        raise UsageError(f"--threads must be at least 1 ({f.threads})")
    target, draft = models_or_demo(target, draft)
    draft = draft_for_drafters(settings, draft)
    warn(pair_warning(target, draft), quiet)
    engine = engine_config(target, draft, settings, f, ctx=ctx)
    chat = open_chat(engine, template=template, settings=settings, system=system)
    final = None
    # Undecodable input bytes arrive as lone surrogates, which ChatSession.ask refuses with one line per turn.
    with contextlib.suppress(AttributeError, ValueError):
        sys.stdin.reconfigure(errors="surrogateescape")
    try:
        if sys.stdin.isatty():
            # markup off: the user's own text ("/k [red]x") is echoed in messages and must print as typed
            console = Console(highlight=False, no_color=no_color, markup=False)
            color = not no_color and console.is_terminal
            banner = (f"specq chat · target {Path(target).name}"
                      + (f" · draft {Path(draft).name}" if draft else " · no draft")
                      + f" · ctx {chat.n_ctx} · /help for commands, Ctrl-D to leave")
            code = interactive(chat, console, color, panel=not quiet, banner=banner)
        else:
            code = piped(chat, sys.stdin, sys.stdout, Console(stderr=True, highlight=False, no_color=True, markup=False,
                                                              soft_wrap=True))
            final = chat.totals.final_line()
    finally:
        chat.engine.close()
    if final is not None:  # last on stderr, after anything closing the models may log
        print(json.dumps(final), file=sys.stderr, flush=True)
    raise typer.Exit(code)
