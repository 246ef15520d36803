"""The docs' commands are the tested ones: `bash runnable` blocks run as written (on the demo pair); every
other `specq ...` command in docs/*.md and README.md must parse with the CLI's real options."""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import typer

from cli_bin import BIN_DIR
from specq.cli.main import app
from specq.native.control.expected import ideal_speedup

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)
SHELL_INFOS = {"bash", "sh", "shell", "console"}
CLI = typer.main.get_command(app)


def blocks(path: Path) -> list[tuple[str, str, int]]:
    """(info string, body, first line number) of every fenced block."""
    text = path.read_text(encoding="utf-8")
    return [(m.group(1).strip(), m.group(2), text.count("\n", 0, m.start()) + 1) for m in FENCE.finditer(text)]


def runnable_blocks() -> list[tuple[str, str]]:
    return [(f"{p.name}:{line}", body) for p in DOCS for info, body, line in blocks(p)
            if info.split() == ["bash", "runnable"]]


def shell_commands(body: str) -> list[list[str]]:
    """The argv of every `specq` command in a shell block (continuations joined, pipes and && split)."""
    cmds = []
    for line in body.replace("\\\n", " ").splitlines():
        tokens = shlex.split(line, comments=True)
        segment: list[str] = []
        for tok in tokens + ["|"]:
            if tok in ("|", "&&", ";", "||", "&"):
                while segment and (re.match(r"^[A-Z_][A-Z0-9_]*=", segment[0]) or segment[0] == "env"):
                    segment.pop(0)  # VAR=value and `env` prefixes
                if segment and segment[0] == "specq":
                    cmds.append([t for t in segment[1:] if not t.startswith((">", "<", "2>"))])
                segment = []
            else:
                segment.append(tok)
    return cmds


def block_commands() -> list[tuple[str, list[str]]]:
    return [(f"{p.name}:{line}", argv) for p in DOCS for info, body, line in blocks(p)
            if info.split()[:1] and info.split()[0] in SHELL_INFOS for argv in shell_commands(body)]


def inline_commands() -> list[tuple[str, list[str]]]:
    """`specq ...` in inline code spans of the prose; '…' ends a command (an elided tail)."""
    out = []
    for p in DOCS:
        text = FENCE.sub("", p.read_text(encoding="utf-8"))
        for m in re.finditer(r"`([^`\n]*\bspecq [^`\n]*)`", text):
            cmd = m.group(1).split("…")[0].split("...")[0]
            for argv in shell_commands(cmd):
                out.append((f"{p.name}: `{m.group(1)}`", argv))
    return out


def option_names(cmd) -> set[str]:
    return {o for prm in cmd.params for o in (*prm.opts, *prm.secondary_opts)} | {"--help"}


def test_the_docs_have_commands_to_check():
    assert len(runnable_blocks()) >= 4 and len(block_commands()) >= 15 and len(inline_commands()) >= 5


@pytest.mark.parametrize("where, argv", [pytest.param(w, a, id=w) for w, a in block_commands()])
def test_block_command_parses(where, argv):
    assert argv, f"{where}: bare `specq`"
    sub = CLI.get_command(None, argv[0])
    assert sub is not None, f"{where}: no command `specq {argv[0]}`"
    if "--help" in argv:
        return
    try:  # parses and converts every value exactly as the real command would, without running it
        sub.make_context(argv[0], list(argv[1:]))
    except Exception as e:  # typer may vendor its own click, so its exception classes are not importable
        msg = e.format_message() if hasattr(e, "format_message") else repr(e)
        pytest.fail(f"{where}: specq {shlex.join(argv)}: {msg}")


@pytest.mark.parametrize("where, argv", [pytest.param(w, a, id=w) for w, a in inline_commands()])
def test_inline_command_uses_real_options(where, argv):
    if argv and argv[0].startswith("-"):  # `specq --help`, `specq --version`
        sub, args = CLI, argv
    else:
        sub, args = (CLI.get_command(None, argv[0]) if argv else None), argv[1:]
    assert sub is not None, f"{where}: no such command"
    known = option_names(sub)
    unknown = [t for t in args if t.startswith("-") and t.split("=")[0] not in known and t != "-"]
    assert not unknown, f"{where}: unknown options {unknown}"


@pytest.mark.parametrize("where, body", [pytest.param(w, b, id=w) for w, b in runnable_blocks()])
def test_runnable_block(where, body, tmp_path):
    env = dict(os.environ, PATH=f"{BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}", HF_HUB_OFFLINE="1",
               COLUMNS="100",
               # llama.cpp's OpenMP threads spin while waiting; on a shared test machine that costs minutes.
               OMP_WAIT_POLICY="PASSIVE")
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, f"{where} failed ({r.returncode}):\n{body}\n{r.stderr[-2000:]}"
    assert "specq: error" not in r.stderr and "Traceback" not in r.stderr


def python_blocks() -> list[tuple[str, str]]:
    return [(f"{p.name}:{line}", body) for p in DOCS for info, body, line in blocks(p)
            if info.split() == ["python", "runnable"]]


@pytest.mark.parametrize("where, body", [pytest.param(w, b, id=w) for w, b in python_blocks()])
def test_runnable_python_block(where, body, tmp_path):
    """The Python API's examples (docs/python-api.md) run as written, by this Python, in a fresh process."""
    import sys

    r = subprocess.run([sys.executable, "-c", body], cwd=tmp_path, env=dict(os.environ, HF_HUB_OFFLINE="1"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{where} failed ({r.returncode}):\n{body}\n{r.stderr[-2000:]}"
    assert r.stdout.strip() and "Traceback" not in r.stderr


def test_the_python_api_page_has_examples_to_run():
    assert len(python_blocks()) >= 3


def test_ideal_speedup_table_matches_the_formula():
    text = (ROOT / "docs" / "guide.md").read_text(encoding="utf-8")
    m = re.search(r"<!-- ideal-speedup-table: alpha \| (.*?) -->\n(.*?)\n\n", text, re.S)
    assert m, "the marked table is missing"
    cols = [tuple(float(v) for v in re.findall(r"k=(\d+),c=([\d.]+)", c)[0]) for c in m.group(1).split(" | ")]
    rows = [r for r in m.group(2).splitlines()[2:] if r.startswith("|")]
    assert len(rows) >= 4
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        alpha = float(cells[0])
        for (k, c), cell in zip(cols, cells[1:], strict=True):
            assert float(cell) == round(ideal_speedup(alpha, int(k), c), 2), (alpha, k, c, cell)


def _string_pieces() -> set[str]:
    """Every string literal (and literal part of an f-string) in the package's code."""
    pieces = set()
    files = list(ROOT.glob("*.py")) + [f for d in ("cli", "native", "convert") for f in (ROOT / d).rglob("*.py")]
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                pieces.add(node.value)
    return pieces


def test_troubleshooting_quotes_real_messages():
    # Each quoted error or hint must end with a "what to do" that the code really prints.
    pieces = _string_pieces()
    text = (ROOT / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    quoted = [line.strip() for info, body, _ in blocks(ROOT / "docs" / "troubleshooting.md") if not info
              for line in body.splitlines()
              if line.startswith(("specq: error:", "draft too", "marginal:", "CPU-only build"))]
    assert len(quoted) >= 12, quoted
    for line in quoted:
        tail = line.rsplit("; ", 1)[-1] if "; " in line else line.split(" — ")[0]
        tail = tail.split("=")[0] if line.startswith("CPU-only build") else tail
        assert any(tail in p for p in pieces), f"not in the code: {tail!r} (from {line!r})"
    for heading in ("Incompatible vocabulary", "No speed-up", "Out of memory", "accept %", "Slow first run"):
        assert heading in text
