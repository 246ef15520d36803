"""Running the command group so that option-parser errors are one `specq: error:` line with the bad value."""

from __future__ import annotations

import sys
import traceback

from typer.core import Abort, _click  # typer vendors its own click: its exception classes live here

from .app import app

USAGE = 2


def _given_value(param, argv: list[str]) -> str | None:
    """The text the user gave for an option, read back from argv (click's message does not carry it)."""
    opts = set(getattr(param, "opts", ()) or ()) | set(getattr(param, "secondary_opts", ()) or ())
    for i, a in enumerate(argv):
        name, eq, val = a.partition("=")
        if name in opts:
            return val if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return None


def usage_line(e, argv: list[str]) -> str:
    """`specq: error: <what> (<value>); <what to do>` for a click usage error."""
    msg = " ".join(e.format_message().split())
    ctx = getattr(e, "ctx", None)
    where = f"`{ctx.command_path} --help`" if ctx is not None else "`specq --help`"
    param = getattr(e, "param", None)
    value = _given_value(param, argv) if param is not None else None
    shown = f" ({value})" if value is not None else ""
    return f"specq: error: {msg}{shown}; see {where}"


def run(argv: list[str]) -> int:
    """Run specq with argv; returns the exit code."""
    try:
        rv = app(args=argv, prog_name="specq", standalone_mode=False)
    except _click.exceptions.NoArgsIsHelpError as e:
        e.show()  # bare `specq` (or a bare group) prints the help, as before
        return USAGE
    except _click.exceptions.UsageError as e:
        print(usage_line(e, argv), file=sys.stderr, flush=True)
        return e.exit_code
    except _click.exceptions.ClickException as e:
        print(f"specq: error: {' '.join(e.format_message().split())}", file=sys.stderr, flush=True)
        return e.exit_code
    except Abort:  # click's EOF at a prompt
        print("specq: interrupted", file=sys.stderr, flush=True)
        return 130
    except Exception as e:  # a bug in specq: still one line; -v shows the traceback to report
        if {"-v", "--verbose"} & set(argv):
            traceback.print_exc()
        print(f"specq: error: internal error ({type(e).__name__}: {' '.join(str(e).split())}); this is a bug in "
              "specq: run again with -v and report the traceback", file=sys.stderr, flush=True)
        return 1
    return rv if isinstance(rv, int) else 0
