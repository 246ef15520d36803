"""The `specq` command group: it only dispatches to one module per command (cli/main.py runs it)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ..version import __version__
from . import bench, chat, convert, doctor, plan, presets, rpc, serve, tune

app = typer.Typer(
    name="specq",
    help="Exact draft-model speculative decoding for local LLMs on llama.cpp.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help texts are plain text: "[tuned]" and "[plot]" must print as written
)
app.command("bench", help="Baseline vs speculative, side by side, in one run.")(bench.main)
app.command("chat", help="Chat with speculative decoding and a live dashboard.")(chat.main)
app.command("doctor", help="Show the llama.cpp build, its devices and whether the GPU is used.")(doctor.main)
app.command("plan", help="Plan GPU layers and context for a target and draft in a VRAM budget.")(plan.main)
app.command("convert", help="Hugging Face checkpoints to an aligned, quantized GGUF target + draft pair.")(convert.main)
app.command("presets", help="List the known target + draft pairs for `specq convert --preset`.")(presets.main)
app.command("serve", help="An OpenAI-compatible server with exact speculative decoding.")(serve.main)
app.command("rpc-build", help="Build llama.cpp's RPC backend for this llama-cpp-python (for --rpc).")(rpc.build_main)
app.command("rpc-server", help="Offer this machine's GPUs or CPU to --rpc clients (no authentication!).")(
    rpc.server_main)
app.command("tune", help="Calibrate a pair: acceptance by position, costs, recommended settings.")(tune.main)


def _version(value: bool) -> None:
    if value:
        print(f"specq {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True,
                                                    help="Print the version and exit.")] = None,
) -> None:
    """specq: speculative decoding on llama.cpp."""
