"""`specq bench` as a library: baseline and speculative runs, alternating, in one process; results are data."""

from __future__ import annotations

import logging
import statistics
from dataclasses import asdict, dataclass, field
from typing import Callable

from .. import __version__
from . import _ffi
from .engine import Engine, Generation, GenerationSettings, GenerationStats

log = logging.getLogger("specq.bench")

DEFAULT_PROMPT = (
    "Write a Python function that returns the n-th Fibonacci number, with a docstring and a short test.\n"
)


@dataclass(frozen=True)
class BenchConfig:
    target: str
    draft: str | None
    prompts: tuple[str, ...]
    settings: GenerationSettings = GenerationSettings()
    ctx: int = 4096
    threads: int | None = None
    ngl: int | None = None  # None: all layers when a GPU is present, else 0
    ngl_draft: int | None = None
    repeat: int = 1
    baseline: bool = True
    extra_settings: dict = field(default_factory=dict)  # other flags to echo in the JSON settings


def default_ngl() -> int:
    return 999 if _ffi.supports_gpu_offload() else 0


def run_record(mode: str, prompt_index: int, repeat: int, gen: Generation) -> dict:
    """One run as the JSON row; speculative-only fields are null on baseline rows."""
    st: GenerationStats = gen.stats
    spec = mode == "speculative"
    row = {
        "mode": mode, "prompt_index": prompt_index, "repeat": repeat, "text": gen.text, "tokens": list(gen.tokens),
        "n_prompt": st.n_prompt, "n_generated": st.n_generated, "tokens_per_s": st.tokens_per_s,
        "prompt_ms": st.prompt_ms, "gen_ms": st.gen_ms,
        "n_steps": st.n_steps if spec else None,
        "n_drafted": st.n_drafted if spec else None,
        "n_accepted": st.n_accepted if spec else None,
        "accept_rate": st.accept_rate if spec else None,
        "mean_accepted_per_step": st.mean_accepted_per_step if spec else None,
        "accepted_per_pos": list(st.accepted_per_pos) if spec else None,
        "draft_ms": st.draft_ms if spec else None,
        "verify_ms": st.verify_ms if spec else None,
        "decode_ms": st.decode_ms, "overhead_fraction": st.overhead_fraction, "stop_reason": st.stop_reason,
    }
    return row


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarize(runs: list[dict], temp: float) -> dict:
    base = [r for r in runs if r["mode"] == "baseline"]
    spec = [r for r in runs if r["mode"] == "speculative"]
    b_tps = _median([r["tokens_per_s"] for r in base])
    s_tps = _median([r["tokens_per_s"] for r in spec])
    identical = None
    if temp == 0 and base and spec:
        ref = {r["prompt_index"]: r["tokens"] for r in base}
        identical = all(r["tokens"] == ref.get(r["prompt_index"]) for r in spec)
    return {
        "baseline_tokens_per_s": b_tps,
        "speculative_tokens_per_s": s_tps,
        "speedup": (s_tps / b_tps) if (b_tps and s_tps) else None,
        "accept_rate": _median([r["accept_rate"] for r in spec]),
        "mean_accepted_per_step": _median([r["mean_accepted_per_step"] for r in spec]),
        "identical_output": identical,
    }


def settings_record(cfg: BenchConfig, threads: int, ngl: int, ngl_draft: int) -> dict:
    s = asdict(cfg.settings)
    s.update({"ctx": cfg.ctx, "threads": threads, "ngl": ngl, "ngl_draft": ngl_draft, "repeat": cfg.repeat,
              "no_baseline": not cfg.baseline})
    s.update(cfg.extra_settings)
    return s


def model_record(engine: Engine, which: str) -> dict:
    info = engine.info(which)
    return {"path": info.path, "size_bytes": info.size_bytes, "n_params": info.n_params}


def run_bench(cfg: BenchConfig, on_run: Callable[[dict], None] | None = None) -> dict:
    """Run baseline and speculative alternately for each prompt and repeat; return the JSON document."""
    cfg.settings.validate()
    ngl = default_ngl() if cfg.ngl is None else cfg.ngl
    ngl_draft = default_ngl() if cfg.ngl_draft is None else cfg.ngl_draft
    with Engine(cfg.target, cfg.draft, ctx=cfg.ctx, threads=cfg.threads, ngl=ngl, ngl_draft=ngl_draft) as eng:
        prompts = [eng.tokenize(p) for p in cfg.prompts]
        modes = (["baseline"] if cfg.baseline else []) + (["speculative"] if cfg.draft else [])
        session = eng.session()
        runs = []
        for rep in range(cfg.repeat):
            for pi, toks in enumerate(prompts):
                for mode in modes:
                    session.reset()
                    gen = session.generate(toks, cfg.settings, speculative=(mode == "speculative")).run()
                    row = run_record(mode, pi, rep, gen)
                    runs.append(row)
                    log.debug("%s prompt %d repeat %d: %.1f tok/s", mode, pi, rep, row["tokens_per_s"])
                    if on_run:
                        on_run(row)
        doc = {
            "specq_version": __version__,
            "llama_cpp_python_version": _ffi.llama_cpp_python_version(),
            "target": model_record(eng, "target"),
            "draft": model_record(eng, "draft") if cfg.draft else None,
            "settings": settings_record(cfg, eng.threads, ngl, ngl_draft),
            "runs": runs,
            "summary": summarize(runs, cfg.settings.temp),
        }
    return doc
