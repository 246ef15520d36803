"""`specq rpc-build` and `specq rpc-server`: llama.cpp's RPC backend for a target split across hosts."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import RpcError, UsageError
from ._common import Quiet, Verbose, err, handle_errors, out, setup_logging, warn

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@handle_errors
def build_main(
    sdist: Annotated[Optional[Path], typer.Option(help="A llama-cpp-python sdist (.tar.gz) of the installed "
                                                       "version (default: pip downloads it).")] = None,
    jobs: Annotated[Optional[int], typer.Option("--jobs", "-j", help="Parallel compile jobs (default: all "
                                                                     "cores).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Rebuild even when the cache has a build.")] = False,
    verbose: Verbose = False,
    quiet: Quiet = False,
) -> None:
    """Build llama.cpp's RPC backend (libggml-rpc.so) for the installed llama-cpp-python, into specq's cache."""
    setup_logging(verbose, quiet)
    from ..native.commands import rpc

    if sdist is not None and not sdist.is_file():
        raise UsageError(f"sdist not found ({sdist}); check the path or omit --sdist")
    if jobs is not None and jobs < 1:
        raise UsageError(f"--jobs must be at least 1 ({jobs})")
    r = rpc.build(sdist=sdist, jobs=jobs, force=force,
                  on_step=(lambda step: None) if quiet else (lambda step: err.print(f"rpc-build: {step}")))
    times = ", ".join(f"{k} {v:.0f} s" for k, v in r.seconds.items())
    state = "already built" if r.cached else "built"
    out.print(f"{state}: {r.library} (llama-cpp-python {r.llama_cpp_python_version}, RPC protocol {r.protocol}"
              + (f"; {times}" if times else "") + ")")


@handle_errors
def server_main(
    host: Annotated[str, typer.Option(help="Address to listen on; the protocol has no authentication, so keep "
                                           "it on loopback or a trusted network.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 50052,
    device: Annotated[Optional[str], typer.Option("--device", help="ggml devices to offer, e.g. CUDA0,CUDA1 "
                                                                   "(default: the GPUs, else the CPU).")] = None,
    threads: Annotated[Optional[int], typer.Option(help="CPU threads for a CPU device (default: physical "
                                                        "cores).")] = None,
    cache: Annotated[bool, typer.Option("--cache", help="Keep received weights in llama.cpp's local file "
                                                        "cache, so the next load sends only hashes.")] = False,
    verbose: Verbose = False,
    quiet: Quiet = False,
) -> None:
    """Offer this machine's GPUs (or CPU) to `specq --rpc` clients over llama.cpp's RPC protocol."""
    setup_logging(verbose, quiet)
    if not 0 < port < 65536:
        raise UsageError(f"--port must be between 1 and 65535 ({port})")
    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be at least 1 ({threads})")
    from ..native.commands import rpc
    from ..machine import physical_cores
    from ..native.commands.placement import parse_devices

    devices = rpc.serve_devices(list(parse_devices(device) or ()))
    warn("llama.cpp's RPC protocol has NO authentication and NO encryption: anyone who can reach "
         f"{host}:{port} can use this machine's devices, read what they compute and send crafted requests; "
         "keep it on loopback (reach it through an SSH tunnel) or a trusted network")
    if host not in LOOPBACK:
        warn(f"listening on {host}, not loopback: make sure only your own hosts can reach port {port} "
             "(a firewall rule or a private network)")
    from ..native.commands.plan import fmt_bytes

    th = rpc.start_server(host, port, devices, threads or physical_cores(),
                          cache_dir=_cache_dir() if cache else None)
    if not quiet:
        names = ", ".join(f"{d.name} ({d.description}, {fmt_bytes(d.memory_free)} free)" for d in devices)
        err.print(f"specq rpc-server: {host}:{port} offers {names}; connect with --rpc {_client_host(host)}:{port}; "
                  "Ctrl-C stops it")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while th.is_alive() and not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        stop.set()
    if not stop.is_set():
        raise RpcError(f"the RPC server on {host}:{port} stopped (run with -v for llama.cpp's log)")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the server thread never returns from C: end the process without waiting for it


def _client_host(host: str) -> str:
    return "<this host's address>" if host in ("0.0.0.0", "::") else host


def _cache_dir() -> str:
    from ..machine import cache_dir

    d = cache_dir() / "rpc-server-cache"
    d.mkdir(parents=True, exist_ok=True)
    return str(d)
