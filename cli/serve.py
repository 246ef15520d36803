"""`specq serve`: an OpenAI-compatible server with exact speculative decoding (the library is native/serving/app.py)."""

from __future__ import annotations

import ipaddress
import logging
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import UsageError
from ._common import (draft_for_drafters, engine_config, ENGINE_FLAGS, Flags, GENERATION_FLAGS, handle_errors,
                      models_or_demo, Quiet, resolve_pair, settings_from_flags, setup_logging, shared_flags, Verbose)


def _route_server_logs(verbose: bool) -> None:
    """uvicorn's own log joins specq's handler: warnings only, its access log with --verbose."""
    handlers = logging.getLogger("specq").handlers
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers = list(handlers) if name == "uvicorn" else []
        lg.propagate = name != "uvicorn"
        lg.setLevel(logging.INFO if verbose else logging.WARNING)


def _exposure_warning(host: str, api_key: str | None) -> str | None:
    """A loud line when the server is reachable from other machines."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        return None
    who = "anyone who can reach this machine" if host in ("0.0.0.0", "::") else f"anyone who can reach {host}"
    key = "an API key is required" if api_key else "WITHOUT an API key (set --api-key or SPECQ_API_KEY)"
    return f"specq: WARNING: listening on {host}: {who} can use the model, {key}"


def _parse_size_flag(flag: str, text: str) -> int:
    from ..native.commands.plan import parse_size

    try:
        return int(text) if text.isdigit() else parse_size(text)
    except UsageError:
        raise UsageError(f"{flag} takes bytes or a size ({text}); e.g. {flag} 4MiB")


@handle_errors
@shared_flags("pair", "target", *GENERATION_FLAGS, *ENGINE_FLAGS)
def main(
    click_ctx: typer.Context,
    draft: Annotated[Optional[Path], typer.Option(help="Draft GGUF; without it the target runs alone.")] = None,
    host: Annotated[str, typer.Option(help="Address to listen on (loopback only by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8080,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="SPECQ_API_KEY", show_envvar=True,
                                                   help="Require 'Authorization: Bearer KEY' on everything but "
                                                        "/health.")] = None,
    max_queue: Annotated[int, typer.Option(help="Requests that may wait for a free sequence; beyond it 503 "
                                                "with Retry-After.")] = 16,
    parallel: Annotated[int, typer.Option(min=1, help="Sequences decoded together (continuous batching: one "
                                                      "target decode verifies them all); --ctx is each one's "
                                                      "context.")] = 1,
    max_body: Annotated[str, typer.Option(help="Largest request body (bytes, or a size such as 4MiB).")] = "4MiB",
    max_tokens: Annotated[int, typer.Option(help="Most tokens one request may generate (also its default).")] = 4096,
    template: Annotated[Optional[str], typer.Option(help="Chat template (a Jinja file or text) when the model "
                                                          "has none or to override its own.")] = None,
    temp: Annotated[float, typer.Option(help="Temperature of requests that give none; 0 is greedy.")] = 0.0,
    seed: Annotated[Optional[int], typer.Option(help="Seed of requests that give none (default: a fresh random "
                                                     "seed per request).")] = None,
    verbose: Verbose = False,
    quiet: Quiet = False,
    *,
    flags: Flags,
) -> None:
    from ..native.serving.app import ServeConfig, bind_socket, open_server, require_serve_extra

    setup_logging(verbose, quiet)
    require_serve_extra()
    f = flags
    target, draft, suggested = resolve_pair(f.pair, f.target, draft, click_ctx)
    ctx = suggested.get("ctx", f.ctx)
    defaults = settings_from_flags(suggested, f, n_predict=max_tokens, temp=temp, seed=seed or 0)
    cfg = ServeConfig(host=host, port=port, api_key=api_key or None, max_queue=max_queue,
                      max_body=_parse_size_flag("--max-body", max_body), max_tokens=max_tokens, seed=seed).validate()
    target, draft = models_or_demo(target, draft)
    draft = draft_for_drafters(defaults, draft)
    warning = _exposure_warning(host, cfg.api_key)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    sock = bind_socket(host, port)
    try:
        engine = engine_config(target, draft, defaults, f, ctx=ctx, parallel=parallel)
        server = open_server(engine, template=template, defaults=defaults, cfg=cfg)
        try:
            _route_server_logs(verbose)
            ready = (f"specq serve: {server.state.limits.model_id}"
                     + (f" + draft {Path(draft).name}" if draft else " (no draft)")
                     + f" on http://{host}:{sock.getsockname()[1]}/v1 · Ctrl-C stops")
            server.serve(sock, verbose=verbose, on_ready=lambda: print(ready, file=sys.stderr, flush=True))
        finally:
            server.close()
    finally:
        sock.close()
    if not quiet:
        print("specq serve: stopped", file=sys.stderr, flush=True)
