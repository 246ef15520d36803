"""`specq bench` as a library: baseline and speculative runs, alternating, in one process; results are data."""

from __future__ import annotations

import json
import logging
import statistics
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Callable

from ...version import __version__
from ...atomic import write_text
from ...errors import UsageError, check_text
from ..llama import ffi as _ffi
from ..control.report import pool
from ..runtime.config import EngineConfig
from ..runtime.engine import Engine
from ..runtime.generation import Generation
from ..core.settings import GenerationSettings
from ..core.stats import GenerationStats
from ..drafters.registry import speculates

log = logging.getLogger("specq.bench")

DEFAULT_PROMPT = (
    "Write a Python function that returns the n-th Fibonacci number, with a docstring and a short test.\n"
)


@dataclass(frozen=True)
class BenchConfig:
    engine: EngineConfig  # the pair and how it loads (cli/_common.engine_config builds it from the flags)
    prompts: tuple[str, ...]
    settings: GenerationSettings = GenerationSettings()
    repeat: int = 1
    baseline: bool = True
    extra_settings: dict = field(default_factory=dict)  # other flags to echo in the JSON settings
    sweep: tuple[tuple[int, float], ...] = ()  # (draft_max, p_min) points; empty: just `settings`
    prompt_names: tuple[str, ...] = ()
    chat: bool = False  # wrap each prompt as one user turn in the target's chat template

    @property
    def speculative(self) -> bool:
        """Whether there is anything to draft with: a draft model, or n-gram lookup alone."""
        return speculates(self.engine, self.settings.drafters)

    def points(self) -> list[tuple[int, float]]:
        return list(self.sweep) or [(self.settings.draft_max, self.settings.p_min)]

    def n_runs(self) -> int:
        per_prompt = int(self.baseline) + (len(self.points()) if self.speculative else 0)
        return self.repeat * len(self.prompts) * per_prompt


def load_prompt_set(name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A built-in prompt set from specq/models/prompts/NAME.jsonl: (names, prompts)."""
    folder = resources.files("specq.models") / "prompts"
    f = folder / f"{name}.jsonl"
    if not f.is_file():
        known = sorted(p.name[:-6] for p in folder.iterdir() if p.name.endswith(".jsonl"))
        raise UsageError(f"unknown prompt set ({name}); choose one of {', '.join(known)}")
    return read_prompt_set(f.read_text(encoding="utf-8"))


def read_prompt_set(text: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A prompt set's JSONL text, one {"name", "prompt"} object per line: (names, prompts)."""
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return tuple(r["name"] for r in rows), tuple(r["prompt"] for r in rows)


def read_prompts(prompts: list[str] | None, prompt_file: Path | None) -> tuple[str, ...]:
    """--prompt (repeatable) or --prompt-file (whole file; .jsonl: one {"prompt": ...} per line)."""
    if prompts and prompt_file:
        raise UsageError("give --prompt or --prompt-file, not both")
    if prompt_file is None:
        return tuple(check_text(p, "--prompt") for p in prompts) if prompts else (DEFAULT_PROMPT,)
    if not prompt_file.is_file():
        raise UsageError(f"prompt file not found ({prompt_file}); check the path")
    try:
        text = prompt_file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"prompt file is not UTF-8 text ({prompt_file}: byte {e.start}); pass a text file")
    if prompt_file.suffix != ".jsonl":
        return (text,)  # decoded strictly above: no lone surrogate
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            out.append(obj["prompt"])
        except (ValueError, KeyError, TypeError):
            raise UsageError(f'{prompt_file}:{n} is not a {{"prompt": "..."}} JSON object; fix that line')
        if isinstance(out[-1], str):
            check_text(out[-1], f"the prompt at {prompt_file}:{n}")
    if not out:
        raise UsageError(f"no prompts in {prompt_file}")
    return tuple(out)


def prompt_tokens(eng: Engine, cfg: BenchConfig) -> list[list[int]]:
    """Raw prompts are tokenized as given (special tokens parsed, like llama.cpp's -p); --chat applies the
    target's chat template to each as a single user turn."""
    if not cfg.chat:
        return [eng.tokenize(p) for p in cfg.prompts]
    from ..core.template import load_template
    from .chat import ChatSession

    template = load_template(None, eng.target.chat_template(), cfg.engine.target)
    return [ChatSession(eng, template).plan_turn(p)[1] for p in cfg.prompts]


def run_record(mode: str, prompt_index: int, repeat: int, gen: Generation, settings: GenerationSettings | None = None,
               prompt_name: str | None = None) -> dict:
    """One run as the JSON row; speculative-only fields are null on baseline rows."""
    st: GenerationStats = gen.stats
    spec = mode == "speculative"
    row = {
        "mode": mode, "prompt_index": prompt_index, "prompt_name": prompt_name, "repeat": repeat,
        "draft_max": settings.draft_max if (spec and settings) else None,
        "p_min": settings.p_min if (spec and settings) else None,
        "text": gen.text, "tokens": list(gen.tokens),
        "n_prompt": st.n_prompt, "n_generated": st.n_generated, "tokens_per_s": st.tokens_per_s,
        "prompt_ms": st.prompt_ms, "gen_ms": st.gen_ms,
        "n_steps": st.n_steps if spec else None,
        "n_drafted": st.n_drafted if spec else None,
        "n_accepted": st.n_accepted if spec else None,
        "accept_rate": st.accept_rate if spec else None,  # accepted ÷ drafted (every draft token verified)
        "alpha": st.alpha if spec else None,  # accepted ÷ draft positions reached (per-position acceptance)
        "mean_accepted_per_step": st.mean_accepted_per_step if spec else None,
        "accepted_per_pos": list(st.accepted_per_pos) if spec else None,
        "draft_ms": st.draft_ms if spec else None,
        "verify_ms": st.verify_ms if spec else None,
        "n_plain_steps": st.n_plain_steps if spec else None,  # draft_max=auto: steps it chose not to draft
        "n_probes": st.n_probes if spec else None,
        "n_handovers": st.n_handovers if spec else None,  # --drafter auto: model steps handed to an n-gram match
        # --drafter suffix: proposed and accepted from earlier answers (the store) and from the request's own text
        **{k: getattr(st, k) if spec else None
           for k in ("n_drafted_store", "n_accepted_store", "n_drafted_text", "n_accepted_text")},
        # a draft of another vocabulary: the steps each translation drafted (--vocab-map auto picks per step)
        **{k: getattr(st, k) if spec else None for k in ("n_vocab_tli_steps", "n_vocab_string_steps")},
        "steps_by_k": {k: n for k, n in st.steps_by_k} if spec else None,  # cost-model inputs (native/control/report.py)
        "tried_per_pos": list(st.tried_per_pos) if spec else None,
        "verify_ms_by_size": {b: [n, ms] for b, n, ms in st.verify_ms_by_size} if spec else None,
        "draft_next_ms": st.draft_next_ms if spec else None,
        "n_draft_next": st.n_draft_next if spec else None,
        "n_drafted_by": dict(st.n_drafted_by) if spec else None,  # per drafter: {"model": n, "ngram": n}
        "n_accepted_by": dict(st.n_accepted_by) if spec else None,
        "n_restores": st.n_restores,  # checkpoint restores (targets or drafts that cannot drop part of a sequence)
        "n_draft_slides": st.n_draft_slides,  # the draft's window moved on (--ctx-draft smaller than --ctx)
        "draft_window": st.draft_window if spec else None,  # recent tokens the draft saw at the end (None: all)
        "n_window_trials": st.n_window_trials if spec else None,  # --ctx-draft auto: windows timed at long context
        "n_window_reverts": st.n_window_reverts if spec else None,  # windows the answer's rows gave up
        "n_rollbacks": st.n_rollbacks,  # recurrent/hybrid tails dropped through state snapshots instead
        "decode_ms": st.decode_ms, "overhead_fraction": st.overhead_fraction, "stop_reason": st.stop_reason,
    }
    return row


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _span(values: list[float | None]) -> tuple[float | None, float | None]:
    vals = [v for v in values if v is not None]
    return (min(vals), max(vals)) if vals else (None, None)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if (a is not None and b) else None


def _draft_min_for(draft_min: int, draft_max: int | str) -> int:
    return min(draft_min, draft_max) if isinstance(draft_max, int) else draft_min


def cost_model(base: list[dict], spec: list[dict], draft_max: int | str | None) -> dict:
    """Measured α, costs and the speed-ups they imply (native/control/report.py), next to the measured one.

    α = accepted ÷ draft positions reached (every earlier one accepted), pooled over the runs: the per-position
    acceptance of E(k), not accept_rate (accepted ÷ every draft token verified).
    c = draft ms per drafted token ÷ target ms per baseline token; v = verify ms per step ÷ the same.
    `predicted_speedup`: the adaptive controller's model on this run's measurements (per-position acceptance,
    first and further draft-token costs, verify cost by batch size, overhead; draft_max auto too);
    `ideal_speedup`: the same with every verify pass as cheap as one baseline token."""
    drafted = sum(r["n_drafted"] for r in spec)
    steps = sum(r["n_steps"] for r in spec)
    alpha = _ratio(sum(r["n_accepted"] for r in spec), sum(sum(r["tried_per_pos"]) for r in spec))
    draft_tok = _ratio(sum(r["draft_ms"] for r in spec), drafted)
    verify_step = _ratio(sum(r["verify_ms"] for r in spec), steps)
    base_tok = _median([_ratio(r["gen_ms"], r["n_generated"]) for r in base])
    base_tps = _median([r["tokens_per_s"] for r in base])
    costs = pool(spec)
    predicted = costs.predicted_tokens_per_s() if costs else None
    ideal = costs.ideal_tokens_per_s(base_tok) if costs else None
    return {
        "alpha": alpha, "draft_ms_per_token": draft_tok, "verify_ms_per_step": verify_step,
        "baseline_ms_per_token": base_tok, "cost_ratio": _ratio(draft_tok, base_tok),
        "verify_cost": _ratio(verify_step, base_tok),
        "alpha_per_pos": costs.alphas() if costs else None,
        "draft_first_ms": costs.t_first() if costs else None,
        "draft_next_ms": costs.t_next() if costs and costs.n_draft_next else None,
        "verify_ms_by_size": {b: costs.verify_ms(b) for b in sorted(costs.verify_ms_by_size)} if costs else None,
        "overhead_ms_per_step": costs.overhead_ms / costs.n_steps if costs and costs.n_steps else None,
        "predicted_tokens_per_s": predicted, "ideal_tokens_per_s": ideal,
        "predicted_speedup": _ratio(predicted, base_tps), "ideal_speedup": _ratio(ideal, base_tps),
    }


def acceptance_histogram(spec: list[dict]) -> tuple[list[int], list[float]]:
    """Summed accepted_per_pos (steps accepting ≥ i+1 draft tokens) and its share of all steps."""
    width = max((len(r["accepted_per_pos"]) for r in spec), default=0)
    counts = [sum(r["accepted_per_pos"][i] for r in spec if i < len(r["accepted_per_pos"])) for i in range(width)]
    steps = sum(r["n_steps"] for r in spec)
    return counts, [c / steps for c in counts] if steps else []


def summarize(runs: list[dict], temp: float, draft_max: int | None = None, p_min: float | None = None) -> dict:
    base = [r for r in runs if r["mode"] == "baseline"]
    spec = [r for r in runs if r["mode"] == "speculative"]
    b_tps = _median([r["tokens_per_s"] for r in base])
    s_tps = _median([r["tokens_per_s"] for r in spec])
    identical = None
    if temp == 0 and base and spec:
        ref = {r["prompt_index"]: r["tokens"] for r in base}
        identical = all(r["tokens"] == ref.get(r["prompt_index"]) for r in spec)
    b_lo, b_hi = _span([r["tokens_per_s"] for r in base])
    s_lo, s_hi = _span([r["tokens_per_s"] for r in spec])
    counts, shares = acceptance_histogram(spec)
    out = {
        "baseline_tokens_per_s": b_tps,
        "speculative_tokens_per_s": s_tps,
        "speedup": (s_tps / b_tps) if (b_tps and s_tps) else None,
        "accept_rate": _median([r["accept_rate"] for r in spec]),
        "mean_accepted_per_step": _median([r["mean_accepted_per_step"] for r in spec]),
        "identical_output": identical,
        "draft_max": draft_max, "p_min": p_min,
        "baseline_tokens_per_s_min": b_lo, "baseline_tokens_per_s_max": b_hi,
        "speculative_tokens_per_s_min": s_lo, "speculative_tokens_per_s_max": s_hi,
        "accepted_per_pos": counts, "accept_at_pos": shares,
    }
    out.update(cost_model(base, spec, draft_max) if spec else {})
    return out


def recommend(sweep: list[dict]) -> dict | None:
    """The sweep point with the highest median speculative tokens/s."""
    pts = [p for p in sweep if p["summary"]["speculative_tokens_per_s"] is not None]
    if not pts:
        return None
    best = max(pts, key=lambda p: p["summary"]["speculative_tokens_per_s"])
    s = best["summary"]
    return {"draft_max": best["draft_max"], "p_min": best["p_min"],
            "speculative_tokens_per_s": s["speculative_tokens_per_s"], "speedup": s["speedup"]}


def settings_record(cfg: BenchConfig, threads: int) -> dict:
    s = asdict(cfg.settings)
    s.update({"ctx": cfg.engine.ctx, "threads": threads, "ngl": cfg.engine.ngl, "ngl_draft": cfg.engine.ngl_draft,
              "repeat": cfg.repeat,
              "no_baseline": not cfg.baseline})
    s.update(cfg.extra_settings)
    return s


def model_record(engine: Engine, which: str) -> dict:
    info = engine.info(which)
    return {"path": info.path, "size_bytes": info.size_bytes, "n_params": info.n_params}


def draft_record(engine: Engine) -> dict:
    """The draft's record, with its vocabulary against the target's (core/vocabmap.py): `vocabulary` same, padded
    or different; for a different one the translation that ran (`vocab_map`; under --vocab-map auto the one that
    drafted more steps, and `vocab_map_steps` the steps each drafted) and `vocab_overlap`."""
    chooser = engine.vocab_chooser
    return {**model_record(engine, "draft"), "vocabulary": engine.vocabulary, "vocab_map": engine.vocab_translation,
            "vocab_map_steps": None if chooser is None else chooser.steps,
            "vocab_overlap": None if engine.vocab_overlap is None else round(engine.vocab_overlap, 4)}


# Two tokens whose target logits are closer than this are a near tie: llama.cpp's batched (verify) and
# single-token (plain) kernels round differently (here up to ~0.05 on a CPU, F32 weights, F16 KV cache),
# so greedy speculative output can take the other branch there. A wider gap means a bug.
NEAR_TIE_LOGITS = 0.5


def first_divergences(eng: Engine, prompts: list[list[int]], runs: list[dict]) -> list[dict]:
    """For each prompt whose greedy speculative output differs from its baseline: where it first differs, and the
    target's logits of the two tokens there (one evaluation of the common prefix)."""
    out = []
    for pi, toks in enumerate(prompts):
        base = next((r for r in runs if r["mode"] == "baseline" and r["prompt_index"] == pi), None)
        spec = next((r for r in runs if r["mode"] == "speculative" and r["prompt_index"] == pi
                     and r["tokens"] != (base or {}).get("tokens")), None)
        if base is None or spec is None:
            continue
        a, b = base["tokens"], spec["tokens"]
        i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        row = {"prompt_index": pi, "prompt_name": spec["prompt_name"], "draft_max": spec["draft_max"],
               "repeat": spec["repeat"], "token_index": i,
               "baseline_token": a[i] if i < len(a) else None, "speculative_token": b[i] if i < len(b) else None,
               "baseline_logit": None, "speculative_logit": None, "margin": None, "near_tie": None}
        if row["baseline_token"] is not None and row["speculative_token"] is not None:
            ctx = eng.tgt_ctx
            ctx.clear()
            ctx.decode(toks + a[:i], 0, logits="last")
            logits = ctx.logits(1)[0]
            la, lb = float(logits[a[i]]), float(logits[b[i]])
            row.update(baseline_logit=la, speculative_logit=lb, margin=la - lb,
                       near_tie=abs(la - lb) < NEAR_TIE_LOGITS)
        out.append(row)
    return out


def run_bench(cfg: BenchConfig, on_run: Callable[[dict], None] | None = None,
              engine_factory: Callable[..., Engine] | None = None) -> dict:
    """Run baseline and speculative (each sweep point) alternately per prompt and repeat; return the JSON document."""
    cfg.settings.validate()
    points = cfg.points()
    point_settings = [replace(cfg.settings, draft_max=k, p_min=p, draft_min=_draft_min_for(cfg.settings.draft_min, k)).validate()
                      for k, p in points]
    with cfg.engine.open(factory=engine_factory or Engine) as eng:  # bench.Engine: the seam tests replace
        prompts = prompt_tokens(eng, cfg)
        names = list(cfg.prompt_names) or [None] * len(prompts)
        plan = ([("baseline", cfg.settings)] if cfg.baseline else []) + \
            ([("speculative", s) for s in point_settings] if cfg.speculative else [])
        session = eng.session()
        store = getattr(eng, "provided", {}).get("suffix")
        if store is not None:  # every run drafts from the store as it was loaded: bench's own answers in it would
            store.learning = False  # make each repeat a copy of the last
        runs = []
        for rep in range(cfg.repeat):
            for pi, toks in enumerate(prompts):
                for mode, settings in plan:
                    session.reset()
                    gen = session.generate(toks, settings, speculative=(mode == "speculative")).run()
                    row = run_record(mode, pi, rep, gen, settings, names[pi])
                    runs.append(row)
                    log.debug("%s prompt %d repeat %d: %.1f tok/s", mode, pi, rep, row["tokens_per_s"])
                    if on_run:
                        on_run(row)
        base = [r for r in runs if r["mode"] == "baseline"]
        sweep = [{"draft_max": k, "p_min": p,
                  "summary": summarize(base + [r for r in runs if r["mode"] == "speculative"
                                               and (r["draft_max"], r["p_min"]) == (k, p)], cfg.settings.temp, k, p)}
                 for k, p in points]
        best = recommend(sweep) if cfg.sweep else None
        diverged = first_divergences(eng, prompts, runs) if cfg.settings.temp == 0 and cfg.speculative else []
        session.reset()
        main = next((pt for pt in sweep if best and (pt["draft_max"], pt["p_min"]) == (best["draft_max"], best["p_min"])),
                    sweep[0])
        doc = {
            "specq_version": __version__,
            "llama_cpp_python_version": _ffi.llama_cpp_python_version(),
            "target": model_record(eng, "target"),
            "draft": draft_record(eng) if cfg.engine.draft else None,
            # draft_window: a fixed window (--ctx-draft N); with auto, runs[].draft_window says what was taken
            "settings": {**settings_record(cfg, eng.threads), "draft_window": eng.draft_window},
            "prompts": [{"index": i, "name": names[i], "n_tokens": len(t)} for i, t in enumerate(prompts)],
            "runs": runs,
            # Without a sweep: the one point. With one: the recommended point; every point is in `sweep`.
            "summary": main["summary"],
            # Greedy runs only: per prompt whose speculative output differs from the baseline, the first
            # difference and the target's logit margin there (near_tie: numerics, not a bug).
            "divergences": diverged,
        }
        if cfg.sweep:
            doc["sweep"] = sweep
            doc["recommendation"] = best
    return doc


CSV_COLUMNS = ("mode", "prompt_index", "prompt_name", "repeat", "draft_max", "p_min", "n_prompt", "n_generated",
               "tokens_per_s", "prompt_ms", "gen_ms", "n_steps", "n_drafted", "n_accepted", "accept_rate",
               "alpha", "mean_accepted_per_step", "draft_ms", "verify_ms", "decode_ms", "stop_reason")


def write_csv(doc: dict, path) -> None:
    """One row per run (baseline rows leave the speculative columns empty); written atomically."""
    import csv
    import io

    out = io.StringIO(newline="")
    w = csv.writer(out)
    w.writerow(CSV_COLUMNS)
    for r in doc["runs"]:
        w.writerow(["" if r.get(c) is None else r.get(c) for c in CSV_COLUMNS])
    write_text(Path(path), out.getvalue(), "--csv path")
