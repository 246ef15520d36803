"""`specq presets`: the known target + draft pairs that `specq convert --preset NAME` converts."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.text import Text
from rich import box
from rich.table import Table

from ..convert.presets import load_presets
from ._common import Quiet, Verbose, handle_errors, out, setup_logging


def presets_table(presets) -> Table:
    """One row per preset; target and draft (and their quants) on two lines of the same row."""
    t = Table(title="specq presets (sizes are estimates)", title_justify="left", box=box.SIMPLE_HEAD)
    t.add_column("name", no_wrap=True)
    t.add_column("target / draft", no_wrap=True)
    t.add_column("quant", no_wrap=True)
    for col in ("ctx", "draft max", "p min", "download", "VRAM"):
        t.add_column(col, justify="right", no_wrap=True)
    for p in presets:
        s = p.settings
        ctx, vram = str(p.context_length), f"≈{p.vram_gib:.1f} GiB"
        if p.context_length_two_cards is not None:  # second line: on two 24 GiB cards
            ctx += f"\n{p.context_length_two_cards} (2 cards)"
            vram += f"\n≈{p.vram_gib_two_cards:.1f} GiB"
        t.add_row(p.name, f"{p.target}\n{p.draft}", f"{p.target_quant}\n{p.draft_quant}", ctx,
                  str(s["draft_max"]), f"{s['p_min']:g}", f"≈{p.download_gib:.0f} GiB", vram)
    return t


@handle_errors
def main(
    json_out: Annotated[bool, typer.Option("--json", help="Print the presets as a JSON list on stdout.")] = False,
    verbose: Verbose = False,
    quiet: Quiet = False,
) -> None:
    setup_logging(verbose, quiet)
    presets = list(load_presets().values())
    if json_out:
        print(json.dumps([p.to_json() for p in presets], indent=2))
        return
    out.print(presets_table(presets))
    if not quiet:
        for p in presets:
            out.print(Text.assemble((p.name, "bold"), f": {p.note}; vocabularies verified: {p.vocab_verified}"))
        out.print("convert one with: specq convert --preset NAME --out DIR")
