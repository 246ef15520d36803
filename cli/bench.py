"""`specq bench`: baseline vs speculative, side by side, in one run."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from ..errors import UsageError
from ..native.bench import DEFAULT_PROMPT, BenchConfig, run_bench
from ..native.demo import demo_pair
from ..native.engine import GenerationSettings
from ._common import Quiet, Verbose, err, handle_errors, setup_logging


def read_prompts(prompts: list[str] | None, prompt_file: Path | None) -> tuple[str, ...]:
    """--prompt (repeatable) or --prompt-file (whole file; .jsonl: one {"prompt": ...} per line)."""
    if prompts and prompt_file:
        raise UsageError("give --prompt or --prompt-file, not both")
    if prompt_file is None:
        return tuple(prompts) if prompts else (DEFAULT_PROMPT,)
    if not prompt_file.is_file():
        raise UsageError(f"prompt file not found ({prompt_file}); check the path")
    text = prompt_file.read_text(encoding="utf-8")
    if prompt_file.suffix != ".jsonl":
        return (text,)
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            out.append(obj["prompt"])
        except (ValueError, KeyError, TypeError):
            raise UsageError(f'{prompt_file}:{n} is not a {{"prompt": "..."}} JSON object; fix that line')
    if not out:
        raise UsageError(f"no prompts in {prompt_file}")
    return tuple(out)


def _fmt(v, spec: str = ".1f", none: str = "–") -> str:
    return none if v is None else format(v, spec)


def render_table(doc: dict) -> Table:
    """A pure function from the bench document to a Rich table."""
    t = Table(title="specq bench", title_justify="left")
    for col in ("mode", "prompt", "rep", "tokens", "tok/s", "accept", "acc/step", "draft ms", "verify ms", "gen ms"):
        t.add_column(col, justify="left" if col == "mode" else "right")
    for r in doc["runs"]:
        t.add_row(r["mode"], str(r["prompt_index"]), str(r["repeat"]), str(r["n_generated"]),
                  _fmt(r["tokens_per_s"]), _fmt(r["accept_rate"] and 100 * r["accept_rate"], ".1f") +
                  ("%" if r["accept_rate"] is not None else ""),
                  _fmt(r["mean_accepted_per_step"], ".2f"), _fmt(r["draft_ms"], ".0f"), _fmt(r["verify_ms"], ".0f"),
                  _fmt(r["gen_ms"], ".0f"))
    return t


def summary_line(doc: dict) -> str:
    s = doc["summary"]
    parts = [f"baseline {_fmt(s['baseline_tokens_per_s'])} tok/s",
             f"speculative {_fmt(s['speculative_tokens_per_s'])} tok/s",
             f"speed-up {_fmt(s['speedup'], '.2f')}×"]
    if s["accept_rate"] is not None:
        parts.append(f"accept {100 * s['accept_rate']:.1f}%")
    if s["identical_output"] is not None:
        parts.append("output identical to baseline" if s["identical_output"] else "OUTPUT DIFFERS from baseline")
    return " · ".join(parts)


@handle_errors
def main(
    target: Annotated[Optional[Path], typer.Option(help="Target GGUF (default: the built-in demo pair).")] = None,
    draft: Annotated[Optional[Path], typer.Option(help="Draft GGUF, vocabulary-compatible with the target.")] = None,
    prompt: Annotated[Optional[list[str]], typer.Option(help="Prompt text (repeatable); raw, special tokens parsed.")] = None,
    prompt_file: Annotated[Optional[Path], typer.Option(help="A prompt file (.jsonl: one {\"prompt\"} per line).")] = None,
    n_predict: Annotated[int, typer.Option(help="Tokens to generate per run.")] = 128,
    draft_max: Annotated[int, typer.Option(help="Most tokens drafted per step.")] = 8,
    draft_min: Annotated[int, typer.Option(help="Drafts shorter than this are dropped.")] = 0,
    p_min: Annotated[float, typer.Option(help="Stop drafting when the draft's top-1 probability is below this.")] = 0.0,
    temp: Annotated[float, typer.Option(help="Temperature; 0 is greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option(help="Top-k (temp > 0).")] = 40,
    top_p: Annotated[float, typer.Option(help="Top-p (temp > 0).")] = 0.95,
    min_p: Annotated[float, typer.Option(help="Min-p (temp > 0).")] = 0.05,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    ctx: Annotated[int, typer.Option(help="Context size (tokens) for both models.")] = 4096,
    threads: Annotated[Optional[int], typer.Option(help="CPU threads (default: physical cores).")] = None,
    ngl: Annotated[Optional[int], typer.Option(help="Target layers on the GPU (default: all when a GPU is present).")] = None,
    ngl_draft: Annotated[Optional[int], typer.Option(help="Draft layers on the GPU (default: all when a GPU is present).")] = None,
    repeat: Annotated[int, typer.Option(help="Repeats per prompt (medians are reported).")] = 1,
    no_baseline: Annotated[bool, typer.Option("--no-baseline", help="Skip the target-alone runs.")] = False,
    json_out: Annotated[Optional[str], typer.Option("--json", help="Write the results as JSON to PATH, or - for stdout.")] = None,
    verbose: Verbose = False,
    quiet: Quiet = False,
) -> None:
    setup_logging(verbose, quiet)
    settings = GenerationSettings(n_predict=n_predict, draft_max=draft_max, draft_min=draft_min, p_min=p_min,
                                  temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed).validate()
    if repeat < 1:
        raise UsageError(f"--repeat must be at least 1 ({repeat})")
    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be at least 1 ({threads})")
    prompts = read_prompts(prompt, prompt_file)
    if target is None:
        if draft is not None:
            raise UsageError("--draft needs --target; omit both for the demo pair")
        target, draft = demo_pair()
    if draft is None and no_baseline:
        raise UsageError("--no-baseline needs a --draft: there would be nothing to run")
    cfg = BenchConfig(target=str(target), draft=str(draft) if draft else None, prompts=prompts, settings=settings,
                      ctx=ctx, threads=threads, ngl=ngl, ngl_draft=ngl_draft, repeat=repeat, baseline=not no_baseline,
                      extra_settings={"prompt_file": str(prompt_file) if prompt_file else None})
    doc = run_bench(cfg)
    text = json.dumps(doc, indent=2)
    if json_out == "-":
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    elif json_out:
        Path(json_out).write_text(text + "\n", encoding="utf-8")
    if not quiet:
        console = err if json_out == "-" else None
        _print(render_table(doc), summary_line(doc), console)
    elif json_out != "-":
        print(summary_line(doc))


def _print(table: Table, line: str, console) -> None:
    from ._common import out

    c = console or out
    c.print(table)
    c.print(line)
