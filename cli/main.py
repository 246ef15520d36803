"""The `specq` entry point: runs the command group (cli/app.py) and keeps every way out to one stderr line.

Nothing heavy is imported at module level, so a Ctrl-C while numpy, llama.cpp and Rich load is caught
here too (exit 130) instead of printing a traceback from the console script.
"""

from __future__ import annotations

import sys

INTERRUPTED = 130


def __getattr__(name: str):
    if name == "app":  # `from specq.cli.main import app` (tests, CliRunner)
        from .app import app

        return app
    raise AttributeError(name)


def main() -> None:
    try:
        from .usage import run

        code = run(sys.argv[1:])
    except KeyboardInterrupt:
        print("specq: interrupted", file=sys.stderr, flush=True)
        code = INTERRUPTED
    sys.exit(code)


if __name__ == "__main__":
    main()
