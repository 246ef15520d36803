"""`specq tune`: a short calibration of a pair; prints the measurements and the settings it recommends."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from ..atomic import write_text
from ..errors import UsageError
from ..native.core.settings import DRAFT_MAX_CAP
from ..native.commands.tune import DEFAULT_PROMPTS, TuneResult, calibrate, write_tuned
from ..native.core.settings import GenerationSettings
from ._common import (draft_for_drafters, engine_config, err, Flags, handle_errors, models_or_demo, out,
                      PLACEMENT_FLAGS, Quiet, resolve_pair, setup_logging, shared_flags, Verbose, warn)
from .checks import check_finite, check_output_path, pair_warning


def render(result: TuneResult) -> Table:
    t = Table(title="specq tune", title_justify="left")
    t.add_column("measure")
    t.add_column("value", justify="right")
    t.add_row("accept rate (of drafted)", "–" if result.accept_rate is None else f"{100 * result.accept_rate:.1f}%")
    t.add_row("α (per position reached)", "–" if result.alpha is None else f"{100 * result.alpha:.1f}%")
    for i, a in enumerate(result.accept_by_pos, 1):
        t.add_row(f"  acceptance at position {i}", f"{100 * a:.1f}%")
    t.add_row("target ms / token", f"{result.target_ms:.2f}")
    t.add_row("draft ms / token", f"{result.draft_ms:.2f}")
    t.add_row("draft/target cost ratio", f"{result.cost_ratio:.3f}")
    for b, v in result.verify_ms.items():
        t.add_row(f"  verify {b} token{'s' if b > 1 else ''} (ms)", f"{v:.2f}  ({v / result.target_ms:.2f}×)")
    return t


def recommendation(result: TuneResult) -> str:
    if result.recommended_draft_max == 0:
        return ("recommended: plain decoding is faster with this pair here (use --draft-max auto, which falls "
                "back to it, or no draft)")
    return (f"recommended: --draft-max {result.recommended_draft_max} (or auto) · predicted speed-up "
            f"{result.predicted_speedup:.2f}×")


@handle_errors
@shared_flags("target", "draft", "pair", "drafter", *PLACEMENT_FLAGS)
def main(
    click_ctx: typer.Context,
    n_predict: Annotated[int, typer.Option(help="Tokens generated per calibration prompt.")] = 64,
    draft_max: Annotated[int, typer.Option(help="Draft length measured (acceptance by position up to it).")] = 8,
    temp: Annotated[float, typer.Option(help="Temperature of the calibration runs; 0 is greedy.")] = 0.0,
    ctx: Annotated[int, typer.Option(help="Context size (tokens): the calibration prompts are short.")] = 1024,
    write: Annotated[bool, typer.Option("--write", help="Store the result as [tuned] in the pair manifest.")] = False,
    json_out: Annotated[Optional[str], typer.Option("--json", help="Write the result as JSON to PATH, or - for stdout.")] = None,
    verbose: Verbose = False,
    quiet: Quiet = False,
    *,
    flags: Flags,
) -> None:
    f = flags
    pair, drafter = f.pair, f.drafter
    setup_logging(verbose, quiet)
    if not 1 <= draft_max <= DRAFT_MAX_CAP:
        raise UsageError(f"--draft-max must be between 1 and {DRAFT_MAX_CAP} ({draft_max})")
    check_finite(temp=temp)
    if temp < 0:
        raise UsageError(f"--temp must be >= 0 ({temp}); use 0 for greedy decoding")
    if n_predict < 2:
        raise UsageError(f"--n-predict must be at least 2 ({n_predict})")
    if write and pair is None:
        raise UsageError("--write needs --pair: the result is stored in the pair's manifest")
    check_output_path("--json", json_out)
    from ..native.drafters.registry import parse_drafter

    parse_drafter(drafter)  # a bad --drafter fails here, before a model loads
    settings = GenerationSettings(draft_max=draft_max, drafter=drafter).validate()
    target, draft, _ = resolve_pair(pair, f.target, f.draft, click_ctx)
    target, draft = models_or_demo(target, draft)
    warn(pair_warning(target, draft), quiet)
    if draft is None and settings.drafters == ("model",):
        raise UsageError("tune needs a draft model; pass --draft (or a --pair with a draft, or --drafter ngram/mtp)")
    draft = draft_for_drafters(settings, draft)
    engine = engine_config(target, draft, settings, f, ctx=ctx)
    with engine.open() as eng:
        result = calibrate(eng, DEFAULT_PROMPTS, n_predict=n_predict, draft_max=draft_max, temp=temp,
                           drafter=drafter)
    if write:
        path = write_tuned(pair, result)
        if not quiet:
            err.print(f"wrote [tuned] to {path}")
    doc = json.dumps(result.to_dict(), indent=2)
    if json_out == "-":
        sys.stdout.write(doc + "\n")
    elif json_out:
        write_text(Path(json_out), doc + "\n", "--json path")
    console = err if json_out == "-" else out
    if not quiet:
        console.print(render(result))
    if json_out != "-":
        console.print(recommendation(result))
