"""`specq plan`: how many layers of the draft and the target fit in a VRAM budget, from GGUF metadata only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from ..native.commands.plan import CACHE_TYPES, budget_devices, fmt_bytes, parse_budget, plan
from ._common import Quiet, Verbose, fail, handle_errors, out, setup_logging


def render_table(doc: dict) -> Table:
    """A pure function from the plan document to a Rich table."""
    t = Table(title=f"specq plan · ctx {doc['ctx']} · KV cache {doc['cache_type']}", title_justify="left")
    for col in ("model", "GPU layers", "weights", "KV cache", "compute", "whole model"):
        t.add_column(col, justify="left" if col == "model" else "right")
    for which in ("draft", "target"):
        m = doc[which]
        if m is None:
            continue
        t.add_row(which, f"{m['ngl']}/{m['ngl_max']}", fmt_bytes(m["weights_bytes"]), fmt_bytes(m["kv_bytes"]),
                  fmt_bytes(m["compute_bytes"]), fmt_bytes(m["model_bytes"]))
    return t


def device_lines(doc: dict) -> list[str]:
    return [f"{d['name']}" + (f" (RPC server {d['endpoint']})" if d.get("endpoint") else "")
            + f": {fmt_bytes(d['bytes'])} of {fmt_bytes(d['budget_bytes'])} "
            f"(draft {d['draft_layers']} + target {d['target_layers']} layers, "
            f"{fmt_bytes(d['reserve_bytes'])} reserve)" for d in doc["devices"]]


@handle_errors
def main(
    target: Annotated[Path, typer.Option(help="Target GGUF.")],
    vram: Annotated[str, typer.Option(help="VRAM per GPU: 24GiB, or 24GiB,24GiB for two; or a fraction "
                                           "of this machine's free VRAM like 0.9.")],
    draft: Annotated[Optional[Path], typer.Option(help="Draft GGUF (placed fully first).")] = None,
    ctx: Annotated[Optional[int], typer.Option(help="Context size (default: the largest that fits fully, "
                                                    "at least 4096).")] = None,
    cache_type: Annotated[str, typer.Option(help=f"KV cache type: {', '.join(CACHE_TYPES)}.")] = "f16",
    flash_attn: Annotated[bool, typer.Option("--flash-attn/--no-flash-attn",
                                             help="Plan for flash attention (llama.cpp's default on GPUs).")] = True,
    parallel: Annotated[int, typer.Option(min=1, help="Sequences served at once (serve --parallel): the KV "
                                                      "cache of each, --ctx tokens.")] = 1,
    json_out: Annotated[bool, typer.Option("--json", help="Print the plan as JSON on stdout.")] = False,
    rpc: Annotated[Optional[str], typer.Option("--rpc", help="RPC servers HOST:PORT[,...]: their devices come first "
                                                            "with the memory they report; the draft stays local.")] = None,
    verbose: Verbose = False,
    quiet: Quiet = False,
) -> None:
    setup_logging(verbose, quiet)
    budget = parse_budget(vram)  # a malformed size is a usage error (exit 2) before anything is read
    if rpc:
        from ..native.commands import rpc as rpc_backend

        rpc_backend.connect(rpc)
    p = plan(str(target), str(draft) if draft else None, budget_devices(budget), ctx=ctx, cache_type=cache_type,
             flash_attn=flash_attn, parallel=parallel)
    doc = p.to_dict()
    if json_out:
        print(json.dumps(doc, indent=2), flush=True)
    if not p.fits:
        fail(p.reason, 1)
    if json_out:
        return
    if not quiet:
        out.print(render_table(doc))
        for line in device_lines(doc):
            out.print(line)
    out.print(f"{'fits' if p.full_offload else 'partial offload'}: {p.reason}; "
              f"--ngl {p.ngl} --ngl-draft {p.ngl_draft} --ctx {p.ctx}" + (f" --parallel {p.parallel}" if p.parallel > 1 else ""))
