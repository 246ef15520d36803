"""`specq bench`: baseline vs speculative, side by side, in one run."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Group
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from ..atomic import write_text
from ..errors import UsageError
from ..native.commands.bench import BenchConfig, load_prompt_set, read_prompts, run_bench, write_csv
from ..native.commands.bench_plot import check_plot_available, plot_sweep
from ..native.core.settings import GenerationSettings
from ..native.drafters.registry import drafts_without_model
from .checks import check_output_path, pair_warning
from ._common import (ENGINE_FLAGS, GENERATION_FLAGS, Flags, Quiet, Verbose, draft_for_drafters, engine_config, err,
                      handle_errors, models_or_demo, parse_draft_max, resolve_pair, settings_from_flags,
                      setup_logging, shared_flags, warn)


def _fmt(v, spec: str = ".1f", none: str = "–") -> str:
    return none if v is None else format(v, spec)


def _pct0(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.0f}"


def _pct(v) -> str:
    return "–" if v is None else f"{100 * v:.1f}%"


def parse_list(flag: str, text: str | None, conv, what: str = "numbers") -> list:
    """'1,2,4' → [1, 2, 4]; a bad item is a usage error naming the flag."""
    if text is None:
        return []
    try:
        vals = [conv(x.strip()) for x in text.split(",") if x.strip()]
    except (ValueError, UsageError):
        raise UsageError(f"{flag} takes a comma-separated list of {what} ({text}); e.g. {flag} 1,2,4,8")
    if not vals:
        raise UsageError(f"{flag} is empty ({text!r}); e.g. {flag} 1,2,4,8")
    return list(dict.fromkeys(vals))


def _agg(rows: list[dict], key: str):
    vals = [r[key] for r in rows if r[key] is not None]
    return (statistics.median(vals), min(vals), max(vals)) if vals else (None, None, None)


def _translation(draft: dict) -> str:
    """The translation a draft of another vocabulary ran: the one --vocab-map forced, or auto's steps of each."""
    steps = draft.get("vocab_map_steps")
    if not steps:
        return draft["vocab_map"]
    return "auto (" + ", ".join(f"{t} on {n} steps" for t, n in steps.items()) + ")"


def render_table(doc: dict) -> Table:
    """A pure function from the bench document to a Rich table: one row per prompt and mode, medians over
    repeats with the min–max range (short headers so it reads at 80 columns)."""
    multi = bool(doc.get("sweep"))
    draft = doc.get("draft") or {}
    caption = (f"draft of another vocabulary: translated by {_translation(draft)}, "
               f"{draft['vocab_overlap']:.0%} of its mass on shared tokens") if draft.get("vocab_map") else None
    t = Table(title="specq bench" + (" (recommended point)" if multi else ""), title_justify="left",
              caption=caption, caption_justify="left")
    for col in ("prompt", "mode", "tok/s", "min–max", "accept", "α", "acc/st", "draft", "verify"):
        t.add_column(col, justify="left" if col in ("prompt", "mode") else "right")
    s = doc["summary"]
    names = {p["index"]: p["name"] or str(p["index"]) for p in doc.get("prompts", [])}
    for pi in sorted({r["prompt_index"] for r in doc["runs"]}):
        for mode in ("baseline", "speculative"):
            rows = [r for r in doc["runs"] if r["prompt_index"] == pi and r["mode"] == mode
                    and (mode == "baseline" or r.get("draft_max") in (None, s.get("draft_max")))
                    and (mode == "baseline" or r.get("p_min") in (None, s.get("p_min")))]
            if not rows:
                continue
            tps, lo, hi = _agg(rows, "tokens_per_s")
            t.add_row(names.get(pi, str(pi))[:10], "base" if mode == "baseline" else "spec", _fmt(tps),
                      f"{lo:.0f}–{hi:.0f}", _pct(_agg(rows, "accept_rate")[0]), _pct(_agg(rows, "alpha")[0]),
                      _fmt(_agg(rows, "mean_accepted_per_step")[0], ".2f"),
                      _fmt(_agg(rows, "draft_ms")[0], ".0f"), _fmt(_agg(rows, "verify_ms")[0], ".0f"))
    return t


def render_sweep(doc: dict) -> Table:
    """One row per sweep point: tokens/s, speed-up, acceptance (of drafted tokens, and α per position reached), and
    the ideal speed-up from the measured α and c."""
    t = Table(title="sweep · ×: measured speed-up · pred: the cost model on the measured acceptance per position "
                    "and costs · ideal: the same with a verify as cheap as one token · acc%: accepted of drafted · α%: "
                    "accepted per position reached · c, v: a draft token's and a verify's cost in target tokens", title_justify="left")
    for col in ("k", "p-min", "tok/s", "×", "acc%", "α%", "acc/st", "ideal", "pred", "c", "v"):
        t.add_column(col, justify="right")
    best = doc.get("recommendation") or {}
    for pt in doc["sweep"]:
        s = pt["summary"]
        is_best = (pt["draft_max"], pt["p_min"]) == (best.get("draft_max"), best.get("p_min"))
        t.add_row(str(pt["draft_max"]), f"{pt['p_min']:g}", _fmt(s["speculative_tokens_per_s"]),
                  _fmt(s["speedup"], ".2f"), _pct0(s.get("accept_rate")), _pct0(s.get("alpha")),
                  _fmt(s["mean_accepted_per_step"], ".2f"), _fmt(s.get("ideal_speedup"), ".2f"),
                  _fmt(s.get("predicted_speedup"), ".2f"), _fmt(s.get("cost_ratio"), ".3f"),
                  _fmt(s.get("verify_cost"), ".2f"),
                  style="bold" if is_best else None)
    return t


def histogram(summary: dict, width: int = 30) -> Text | None:
    """Per-position acceptance: the share of steps that accepted at least i draft tokens."""
    shares = summary.get("accept_at_pos") or []
    if not shares:
        return None
    out = Text("accepted ≥ i draft tokens, share of steps:\n")
    for i, sh in enumerate(shares, 1):
        out.append(f"  {i:>2} {'█' * round(sh * width):<{width}} {100 * sh:5.1f}%\n")
    return out


def cost_line(summary: dict) -> str | None:
    """The measured cost model next to the measured speed-up."""
    if summary.get("alpha") is None:
        return None
    parts = [f"α {summary['alpha']:.2f}"]
    if summary.get("cost_ratio") is not None:
        parts.append(f"c {summary['cost_ratio']:.3f} (draft ms/token ÷ target ms/token)")
    if summary.get("verify_cost") is not None:
        parts.append(f"verify {summary['verify_cost']:.2f}× a target token")
    if summary.get("predicted_speedup") is not None:
        parts.append(f"predicted {summary['predicted_speedup']:.2f}× (the measured costs and acceptance per "
                     f"position) · ideal {_fmt(summary.get('ideal_speedup'), '.2f')}× (a verify as cheap as one "
                     f"token) · measured {_fmt(summary['speedup'], '.2f')}×")
    return " · ".join(parts)


def recommendation_line(doc: dict) -> str | None:
    best = doc.get("recommendation")
    if not best:
        return None
    sp = f", {best['speedup']:.2f}× the target alone" if best.get("speedup") else ""
    return (f"recommended for this pair and prompts: --draft-max {best['draft_max']} --p-min {best['p_min']:g} "
            f"({best['speculative_tokens_per_s']:.1f} tok/s{sp})")


def summary_line(doc: dict) -> str:
    s = doc["summary"]
    parts = [f"baseline {_fmt(s['baseline_tokens_per_s'])} tok/s",
             f"speculative {_fmt(s['speculative_tokens_per_s'])} tok/s",
             f"speed-up {_fmt(s['speedup'], '.2f')}×"]
    if s["accept_rate"] is not None:
        parts.append(f"accept {100 * s['accept_rate']:.1f}% of drafted")
    if s.get("alpha") is not None:
        parts.append(f"α {100 * s['alpha']:.1f}% per position")
    if s["identical_output"] is not None:
        parts.append("output identical to baseline" if s["identical_output"] else "OUTPUT DIFFERS from baseline")
    return " · ".join(parts)


def divergence_lines(doc: dict) -> list[str]:
    """One line per prompt whose greedy speculative output differs from the baseline: where, and why."""
    lines = []
    for d in doc.get("divergences") or []:
        name = d["prompt_name"] or f"#{d['prompt_index']}"
        where = (f"prompt {name} (draft-max {d['draft_max']}): output first differs at generated token "
                 f"{d['token_index']}")
        if d["margin"] is None:
            lines.append(f"{where}, where one run stopped and the other did not")
        elif d["near_tie"]:
            lines.append(f"{where}, a near tie (target logits {d['baseline_logit']:.3f} vs "
                         f"{d['speculative_logit']:.3f}): batched and single-token evaluation round it differently; "
                         "not a bug (docs/troubleshooting.md)")
        else:
            lines.append(f"{where} and the target's logits there are {abs(d['margin']):.2f} apart: NOT a near tie, "
                         "this is a bug; please report it with this JSON")
    return lines


def report(doc: dict) -> Group:
    """Everything the human sees after a run, as one renderable."""
    parts = [render_table(doc)]
    if doc.get("sweep"):
        parts.append(render_sweep(doc))
    parts.append(Text(summary_line(doc)))
    parts.extend(Text(line) for line in divergence_lines(doc))
    for extra in (cost_line(doc["summary"]), histogram(doc["summary"]), recommendation_line(doc)):
        if extra:
            parts.append(extra if isinstance(extra, Text) else Text(extra))
    return Group(*parts)


def _progress(total: int, enabled: bool):
    """A progress bar on stderr for long runs (only when stderr is a terminal and not --quiet)."""
    if not enabled or total < 2:
        return None
    return Progress(TextColumn("bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("{task.description}"), console=err, transient=True)


@handle_errors
@shared_flags("pair", "target", "draft", *GENERATION_FLAGS, *ENGINE_FLAGS)
def main(
    click_ctx: typer.Context,
    prompt: Annotated[Optional[list[str]], typer.Option(help="Prompt text (repeatable); raw, special tokens parsed.")] = None,
    prompt_file: Annotated[Optional[Path], typer.Option(help="A prompt file (.jsonl: one {\"prompt\"} per line).")] = None,
    n_predict: Annotated[int, typer.Option(help="Tokens to generate per run.")] = 128,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap each prompt as a user turn in the target's chat "
                                                      "template (default: raw text, as llama.cpp's -p).")] = False,
    repeat: Annotated[int, typer.Option(help="Repeats per prompt (medians are reported).")] = 1,
    no_baseline: Annotated[bool, typer.Option("--no-baseline", help="Skip the target-alone runs.")] = False,
    json_out: Annotated[Optional[str], typer.Option("--json", help="Write the results as JSON to PATH, or - for stdout.")] = None,
    sweep_draft_max: Annotated[Optional[str], typer.Option(
        help="Sweep draft-max over a list, e.g. 1,2,4,8 (auto may be one of them).")] = None,
    sweep_p_min: Annotated[Optional[str], typer.Option(help="Sweep p-min over a list, e.g. 0,0.5,0.9.")] = None,
    prompt_set: Annotated[Optional[str], typer.Option(help="A built-in prompt set: default (code, chat, reasoning, "
                                                            "Chinese, a long-document summary).")] = None,
    csv_out: Annotated[Optional[Path], typer.Option("--csv", help="Write one CSV row per run to PATH.")] = None,
    plot: Annotated[Optional[Path], typer.Option(help="Write tokens/s and acceptance vs draft-max to a PNG "
                                                      "(needs matplotlib: specq[plot]).")] = None,
    verbose: Verbose = False,
    quiet: Quiet = False,
    *,
    flags: Flags,
) -> None:
    f = flags
    setup_logging(verbose, quiet)
    target, draft, suggested = resolve_pair(f.pair, f.target, f.draft, click_ctx)
    ctx = suggested.get("ctx", f.ctx)
    settings = settings_from_flags(suggested, f, n_predict=n_predict)
    if repeat < 1:
        raise UsageError(f"--repeat must be at least 1 ({repeat})")
    if f.threads is not None and f.threads < 1:
        raise UsageError(f"--threads must be at least 1 ({f.threads})")
    if prompt_set is not None and (prompt or prompt_file):
        raise UsageError("give --prompt-set, --prompt or --prompt-file, not several")
    names, prompts = load_prompt_set(prompt_set) if prompt_set is not None else ((), read_prompts(prompt, prompt_file))
    ks = parse_list("--sweep-draft-max", sweep_draft_max, parse_draft_max, "numbers or auto") or [settings.draft_max]
    pmins = parse_list("--sweep-p-min", sweep_p_min, float) or [settings.p_min]
    sweep = tuple((k, p) for k in ks for p in pmins) if (sweep_draft_max or sweep_p_min) else ()
    for k, p in sweep:  # fail before loading any model
        GenerationSettings(draft_max=k, p_min=p).validate()
    if plot is not None:
        check_plot_available()
    for flag, path in (("--json", json_out), ("--csv", csv_out), ("--plot", plot)):
        check_output_path(flag, path)  # before the run: a bad path must not cost its results
    target, draft = models_or_demo(target, draft)
    warn(pair_warning(target, draft), quiet)
    drafts = draft is not None or drafts_without_model(settings.drafters)
    if not drafts and no_baseline:
        raise UsageError("--no-baseline needs a --draft (or --drafter ngram): there would be nothing to run")
    if sweep and not drafts:
        raise UsageError("a sweep needs a --draft (or --drafter ngram): there is nothing to sweep without one")
    draft = draft_for_drafters(settings, draft)
    engine = engine_config(target, draft, settings, f, ctx=ctx)
    cfg = BenchConfig(engine=engine, prompts=prompts, settings=settings, repeat=repeat,
                      baseline=not no_baseline, chat=chat,
                      extra_settings={"prompt_file": str(prompt_file) if prompt_file else None,
                                      "vram_budget": f.vram_budget, "main_gpu": f.main_gpu,
                                      "ctx_draft": engine.draft_ctx,
                                      "threads_draft": f.threads_draft,
                                      "tensor_split": f.tensor_split, "device": f.device,
                                      "draft_device": f.draft_device,
                                      "cpu_amx": f.cpu_amx, "rpc": f.rpc, "flash_attn": engine.flash_attn,
                                      "draft_flash_attn": engine.draft_flash_attn,
                                      "prompt_set": prompt_set, "sweep_draft_max": ks if sweep_draft_max else None,
                                      "sweep_p_min": pmins if sweep_p_min else None},
                      sweep=sweep, prompt_names=names)
    progress = _progress(cfg.n_runs(), enabled=not quiet and err.is_terminal)
    if progress is None:
        doc = run_bench(cfg)
    else:
        with progress:
            task = progress.add_task("", total=cfg.n_runs())

            def on_run(row: dict) -> None:
                what = "baseline" if row["mode"] == "baseline" else f"k {row['draft_max']} p-min {row['p_min']:g}"
                progress.update(task, advance=1, description=f"{what}: {row['tokens_per_s']:.1f} tok/s")

            doc = run_bench(cfg, on_run=on_run)
    text = json.dumps(doc, indent=2)
    if json_out == "-":
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    elif json_out:
        _write_atomic(Path(json_out), text + "\n")
    if csv_out is not None:
        write_csv(doc, csv_out)
    if plot is not None:
        plot_sweep(doc, plot)
    if not quiet:
        from ._common import out

        (err if json_out == "-" else out).print(report(doc))
    elif json_out != "-":
        print(summary_line(doc))
        if recommendation_line(doc):
            print(recommendation_line(doc))


def _write_atomic(path: Path, text: str) -> None:
    write_text(path, text, "--json path")
