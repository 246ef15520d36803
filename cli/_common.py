"""What every command shares: -v/-q, logging, and turning specq exceptions into one line and an exit code."""

from __future__ import annotations

import errno
import functools
import logging
import sys
from typing import Annotated, Callable

import typer
from rich.console import Console

from ..errors import SpecqError

Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Show llama.cpp's log and specq's debug log.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="Print only results.")]

# Results go to stdout; tables, progress and messages to stderr unless a command says otherwise.
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False)


def setup_logging(verbose: bool = False, quiet: bool = False) -> None:
    """llama.cpp's log (logger specq.llama) and debug output appear only with --verbose."""
    root = logging.getLogger("specq")
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    root.addHandler(handler)
    root.propagate = False
    if verbose:
        root.setLevel(logging.DEBUG)
        logging.getLogger("specq.llama").setLevel(logging.DEBUG)
    else:
        root.setLevel(logging.ERROR if quiet else logging.WARNING)
        logging.getLogger("specq.llama").setLevel(logging.CRITICAL + 1)


def fail(message: str, code: int = 1) -> None:
    """Print exactly one line on stderr and exit."""
    print(f"specq: error: {message}", file=sys.stderr, flush=True)
    raise typer.Exit(code)


def handle_errors(fn: Callable) -> Callable:
    """Run a command body: SpecqError → one line + its exit code; Ctrl-C → 130; full disk → 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except SpecqError as e:
            fail(str(e), e.exit_code)
        except KeyboardInterrupt:
            print("specq: interrupted", file=sys.stderr, flush=True)
            raise typer.Exit(130)
        except BrokenPipeError:
            # The reader went away (`specq plan | head`): not an error worth a message.
            import os

            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise typer.Exit(0)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                fail(f"no space left on the device ({e.filename or 'output'}); free some disk space and retry")
            fail(f"{e.strerror or e} ({e.filename or ''}); check the path and permissions")

    return wrapper
