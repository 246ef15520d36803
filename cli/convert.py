"""`specq convert`: Hugging Face checkpoints -> an aligned, quantized GGUF target + draft pair."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

from ..convert.pipeline import convert_pair
from ..convert.presets import get_preset
from ..errors import UsageError
from ._common import Quiet, Verbose, err, handle_errors, out, setup_logging, warn


class _Bars:
    """Renders the library's (task, done, total) progress calls as one Rich bar per task, on stderr."""

    def __init__(self, progress: Progress):
        self.p = progress
        self.tasks: dict[str, int] = {}

    def __call__(self, task: str, done: int, total: int) -> None:
        if task not in self.tasks:
            self.tasks[task] = self.p.add_task(task, total=max(total, 1))
        self.p.update(self.tasks[task], completed=done, total=max(total, 1))


def same_checkpoint(target: str, draft: str, revision: str | None, draft_revision: str | None) -> bool:
    """The same local folder (by its real path) or the same Hub repo id at the same revision."""
    t, d = Path(target).expanduser(), Path(draft).expanduser()
    if t.exists() or d.exists():
        return t.exists() and d.exists() and t.resolve() == d.resolve()
    return target.strip().lower() == draft.strip().lower() and revision == draft_revision


@handle_errors
def main(
    target: Annotated[Optional[str], typer.Argument(help="Target: a Hugging Face repo id or a local checkpoint "
                                                         "folder (omit with --preset).")] = None,
    out_dir: Annotated[Optional[Path], typer.Option("--out", help="Output folder for the GGUF files and "
                                                                  "specq-pair.toml.")] = None,
    draft: Annotated[Optional[str], typer.Option(help="Draft: a repo id or folder with the same vocabulary.")] = None,
    preset: Annotated[Optional[str], typer.Option(help="A known pair (see `specq presets`): its target, draft, "
                                                       "quants and suggested settings.")] = None,
    outtype: Annotated[Optional[str], typer.Option(help="Unquantized type: f16, bf16 or f32 (default: the source dtype).")] = None,
    quant: Annotated[Optional[str], typer.Option(help="Target quantization (Q8_0, Q6_K, Q5_K_M, Q4_K_M, ...) or none "
                                                      "(default: Q4_K_M, or the preset's).")] = None,
    draft_quant: Annotated[Optional[str], typer.Option(help="Draft quantization, or none (default: Q8_0, or "
                                                            "the preset's).")] = None,
    revision: Annotated[Optional[str], typer.Option(help="Hub revision (branch, tag or commit) of the target.")] = None,
    draft_revision: Annotated[Optional[str], typer.Option(help="Hub revision of the draft.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite existing output files.")] = False,
    keep_intermediate: Annotated[bool, typer.Option("--keep-intermediate", help="Keep the F16/BF16 file used for quantizing.")] = False,
    no_mtp: Annotated[bool, typer.Option("--no-mtp", help="Qwen3.5/3.6 targets: drop the multi-token-prediction "
                                                          "blocks (kept by default).")] = False,
    verbose: Verbose = False,
    quiet: Quiet = False,
) -> None:
    setup_logging(verbose, quiet)
    if not verbose:
        logging.getLogger("gguf").setLevel(logging.ERROR)  # gguf-py's own info/warnings about metadata it writes
    if quiet:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if out_dir is None:
        raise UsageError("missing --out; pass the folder for the GGUF files, e.g. --out pairs/my-pair")
    settings = None
    if preset is not None:
        if target is not None or draft is not None:
            raise UsageError(f"--preset sets the target and draft ({preset}); pass either --preset or TARGET [--draft]")
        known = get_preset(preset)
        target, draft, settings = known.target, known.draft, known.manifest_settings()
        quant = quant if quant is not None else known.target_quant
        draft_quant = draft_quant if draft_quant is not None else known.draft_quant
    elif target is None:
        raise UsageError("missing TARGET; pass a Hub repo id or checkpoint folder, or --preset NAME (see `specq presets`)")
    if draft is not None and same_checkpoint(target, draft, revision, draft_revision):
        warn(f"the draft is the target's own checkpoint ({draft}); a pair of one model drafts nothing useful: pass a "
             "smaller model of the same family as --draft, or omit --draft", quiet)
    kwargs = dict(draft=draft, outtype=outtype, quant=quant if quant is not None else "Q4_K_M",
                  draft_quant=draft_quant if draft_quant is not None else "Q8_0", revision=revision,
                  draft_revision=draft_revision, force=force, keep_intermediate=keep_intermediate, settings=settings,
                  mtp=not no_mtp)
    if quiet:
        result = convert_pair(target, out_dir, **kwargs)
    else:
        columns = (TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeRemainingColumn())
        # transient: a failure leaves only its one error line; no bars when stderr is not a terminal
        with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as p:
            result = convert_pair(target, out_dir, progress=_Bars(p), **kwargs)
    out.print(f"target: {result.target_path}")
    if result.draft_path is not None:
        out.print(f"draft:  {result.draft_path}")
    for p in result.intermediates:
        out.print(f"kept:   {p}")
    if result.mtp_layers:
        out.print(f"mtp:    {result.mtp_layers} block(s), {result.mtp_bytes / 1e6:.1f} MB in the target "
                  "(--no-mtp drops them)")
    out.print(f"pair:   {result.manifest_path}")
