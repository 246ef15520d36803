"""`specq bench --plot`: tokens/s and acceptance against draft-max, one line per p-min (matplotlib, optional);
a draft-max "auto" point, which has no single draft length, is a dotted level line."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from ...atomic import atomic_output
from ...errors import SpecqError


def check_plot_available() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise SpecqError("--plot needs matplotlib (not installed); run `pip install 'specq[plot]'` or drop --plot")


def plot_sweep(doc: dict, path: str | os.PathLike) -> Path:
    """Write a PNG with two panels: speculative tokens/s (baseline dashed) and acceptance, against draft-max."""
    check_plot_available()
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    path = Path(path)
    if not path.parent.is_dir():
        raise SpecqError(f"folder not found ({path.parent}); create it first or pick another --plot path")
    points = doc.get("sweep") or [{"draft_max": doc["summary"]["draft_max"], "p_min": doc["summary"]["p_min"],
                                   "summary": doc["summary"]}]
    fig, (ax_tps, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for p_min in sorted({p["p_min"] for p in points}):
        for p in points:
            if p["p_min"] == p_min and p["draft_max"] == "auto":
                ax_tps.axhline(p["summary"]["speculative_tokens_per_s"], linestyle=":", color="black",
                               label=f"auto, p-min {p_min:g}")
                if p["summary"].get("alpha") is not None:
                    ax_acc.axhline(100 * p["summary"]["alpha"], linestyle=":", color="black",
                                   label=f"auto, p-min {p_min:g}")
        pts = sorted((p for p in points if p["p_min"] == p_min and p["draft_max"] != "auto"),
                     key=lambda p: p["draft_max"])
        ks = [p["draft_max"] for p in pts]
        tps = [p["summary"]["speculative_tokens_per_s"] for p in pts]
        acc = [None if p["summary"].get("alpha") is None else 100 * p["summary"]["alpha"] for p in pts]
        ax_tps.plot(ks, tps, marker="o", label=f"p-min {p_min:g}")
        ax_acc.plot(ks, acc, marker="o", label=f"p-min {p_min:g}")
    base = doc["summary"].get("baseline_tokens_per_s")
    if base:
        ax_tps.axhline(base, linestyle="--", color="grey", label="target alone")
    ax_tps.set(xlabel="draft-max", ylabel="tokens/s", title="speculative tokens/s")
    ax_acc.set(xlabel="draft-max", ylabel="acceptance (%)", title="acceptance", ylim=(0, 105))
    for ax in (ax_tps, ax_acc):
        ax.grid(alpha=0.3)
        ax.set_xticks(sorted({p["draft_max"] for p in points if p["draft_max"] != "auto"}))
        ax.legend(fontsize="small")
    fig.suptitle(f"specq bench: {Path(doc['target']['path']).name}"
                 + (f" + {Path(doc['draft']['path']).name}" if doc.get("draft") else ""), fontsize="medium")
    fig.tight_layout()
    try:
        with atomic_output(path) as tmp:
            fig.savefig(tmp, dpi=100, format="png")
    finally:
        plt.close(fig)
    return path
