"""`specq doctor`: which llama.cpp build is installed, which devices it can use, and a one-line verdict."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer
from rich.table import Table

from ..native.commands.doctor import doctor_report
from ._common import Quiet, Verbose, handle_errors, out, setup_logging

GiB = 1 << 30


def render_devices(doc: dict) -> Table:
    """A pure function from the report to a Rich table of ggml devices."""
    t = Table(title="ggml devices", title_justify="left")
    for col in ("name", "type", "description", "total", "free"):
        t.add_column(col, justify="right" if col in ("total", "free") else "left")
    for d in doc["devices"]:
        t.add_row(d["name"], d["type"], d["description"], f"{d['memory_total'] / GiB:.1f} GiB",
                  f"{d['memory_free'] / GiB:.1f} GiB")
    return t


def rpc_line(r: dict) -> str:
    if not r["available"]:
        return f"RPC (--rpc): not available — {r['reason']}"
    where = r["library"] or r["source"]
    servers = "; ".join(f"{s['endpoint']} (protocol {s['protocol']}, {s['n_devices']} device(s))" for s in r["servers"])
    return f"RPC (--rpc): available ({where})" + (f"; servers: {servers}" if servers else "")


@handle_errors
def main(
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout.")] = False,
    rpc: Annotated[Optional[str], typer.Option("--rpc", help="Also list the devices of these RPC servers "
                                                            "(HOST:PORT[,HOST:PORT...]).")] = None,
    verbose: Verbose = False,
    quiet: Quiet = False,
) -> None:
    setup_logging(verbose, quiet)
    doc = doctor_report(rpc)
    if json_out:
        print(json.dumps(doc, indent=2), flush=True)
        return
    if not quiet:
        out.print(f"specq {doc['specq_version']} · llama-cpp-python {doc['llama_cpp_python_version']}")
        out.print(f"system info: {doc['system_info']}")
        out.print(f"GPU offload supported: {'yes' if doc['gpu_offload'] else 'no'}")
        out.print(render_devices(doc))
        for g in doc["nvidia_gpus"]:
            mem = f"{g['memory_total'] / GiB:.0f} GiB" if g["memory_total"] else "?"
            out.print(f"NVIDIA GPU {g['index']}: {g['name']} (CC {g['compute_capability'] or '?'}, {mem}; "
                      f"from {g['source']})")
        cpu = doc["cpu"]
        out.print(f"CPU weight buffers: {cpu['extra_buffers']} — {cpu['reason']}")
        out.print(rpc_line(doc["rpc"]))
    out.print(doc["verdict"])
