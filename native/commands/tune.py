"""`specq tune` as a library: a short calibration of a pair, and the settings it recommends.

Measures the target's verify cost for batch sizes 1..k+1, the draft's cost per token, and the
acceptance at each draft position over a few speculative generations; recommends the draft length
that maximises expected tokens per second (the same formula draft_max=auto uses online).
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict, dataclass

from ..control.expected import best_draft_length, ideal_speedup
from ..runtime.engine import Engine
from ..core.settings import GenerationSettings

log = logging.getLogger("specq.tune")

DEFAULT_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number, with a docstring and a short test.\n",
    "Explain in three sentences why the sky is blue.\n",
)


@dataclass(frozen=True)
class TuneResult:
    accept_by_pos: tuple[float, ...]  # conditional acceptance at draft positions 1..k
    accept_rate: float | None  # n_accepted / n_drafted over the calibration runs (llama.cpp's ratio)
    target_ms: float  # one target token (plain decoding)
    draft_ms: float  # one draft token
    cost_ratio: float  # draft_ms / target_ms
    verify_ms: dict[int, float]  # batch size → ms
    recommended_draft_max: int  # 0: plain decoding is faster with this pair on this machine
    predicted_speedup: float
    temp: float
    drafter: str = "model"
    alpha: float | None = None  # n_accepted / draft positions reached (per-position acceptance, Rates.alpha)
    vocab_map: str | None = None  # a draft of another vocabulary: its translation, and its overlap
    vocab_overlap: float | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["verify_ms"] = {str(k): v for k, v in self.verify_ms.items()}
        return d

    def manifest_table(self) -> dict:
        """Flat scalars for the manifest's [tuned] table."""
        return {
            "draft_max": self.recommended_draft_max if self.recommended_draft_max > 0 else "auto",
            "speculative": self.recommended_draft_max > 0,
            "accept_rate": self.accept_rate, "alpha": self.alpha, "cost_ratio": round(self.cost_ratio, 4),
            "predicted_speedup": round(self.predicted_speedup, 3), "temp": self.temp,
            "accept_by_pos": ",".join(f"{a:.3f}" for a in self.accept_by_pos),
            "verify_ms": ",".join(f"{b}:{v:.3f}" for b, v in self.verify_ms.items()),
            "target_ms": round(self.target_ms, 4), "draft_ms": round(self.draft_ms, 4),
            "drafter": self.drafter,
        }


def _median_ms(fn, n: int) -> float:
    """Median of fn()'s returned seconds, in ms (fn times only the part that matters, not the rollback)."""
    return statistics.median(fn() for _ in range(n)) * 1e3


def measure_costs(eng: Engine, prompt: list[int], max_batch: int, reps: int = 5) -> tuple[dict[int, float], float]:
    """(target verify ms by batch size, draft ms per token), rolling the memories back after each decode."""
    ses = eng.session()
    ses.prefill(prompt)
    model = ses.drafters.get("model")  # the pair's draft model, where one is loaded
    tgt, dft = ses.tgt, model.memory if model is not None else None
    n = len(tgt.tokens)
    filler = (prompt * (max_batch + 1))[:max_batch]

    def timed(cache, tokens, keep, logits):
        cache.save_checkpoint()
        t0 = time.perf_counter()
        cache.extend(tokens, logits=logits)
        dt = time.perf_counter() - t0
        cache.truncate(keep)
        return dt

    verify = {b: _median_ms(lambda b=b: timed(tgt, filler[:b], n, "all"), reps)
              for b in sorted({1, 2, 3, 5, 9, 17, max_batch} & set(range(1, max_batch + 1)))}
    if dft is None:  # no draft model: the drafters' own cost comes from the calibration runs
        return verify, None
    model.read_to(len(ses.history))  # the whole prompt, in the draft's own tokens (another vocabulary's too)
    m = len(dft.tokens)
    return verify, _median_ms(lambda: timed(dft, [dft.tokens[-1]], m, "last"), reps * 2)


def calibrate(eng: Engine, prompts: tuple[str, ...] = DEFAULT_PROMPTS, n_predict: int = 64, draft_max: int = 8,
              temp: float = 0.0, seed: int = 0, drafter: str = "model") -> TuneResult:
    """Run the calibration on a loaded pair (target + draft), or the target with another drafter (--drafter):
    with no draft model, the draft cost per token is the drafting time of the runs over the tokens drafted."""
    toks = [eng.tokenize(p) for p in prompts]
    verify, draft_ms = measure_costs(eng, toks[0], draft_max + 1)
    steps = drafted = accepted = tried = 0
    drafting_ms = 0.0
    at_least = [0] * draft_max
    settings = GenerationSettings(n_predict=n_predict, draft_max=draft_max, temp=temp, seed=seed,
                                  drafter=drafter).validate()
    for t in toks:
        g = eng.session().generate(t, settings).run()
        st = g.stats
        steps += st.n_steps
        drafted += st.n_drafted
        accepted += st.n_accepted
        tried += st.n_tried
        drafting_ms += st.draft_ms
        at_least = [a + b for a, b in zip(at_least, st.accepted_per_pos)]
        log.debug("calibration run: %d steps, accept %.2f", st.n_steps, st.accept_rate or 0.0)
    # conditional acceptance: P(position i accepted | i-1 accepted); near the end some drafts are shorter
    prev, alphas = max(steps, 1), []
    for a in at_least:
        alphas.append(a / prev if prev else 0.0)
        prev = a
    pts = sorted(verify.items())

    def verify_s(b: int) -> float:
        if b in verify:
            return verify[b] / 1e3
        lo = max((p for p in pts if p[0] <= b), default=pts[0])
        hi = min((p for p in pts if p[0] >= b), default=pts[-1])
        if hi[0] == lo[0]:
            return lo[1] / 1e3
        return (lo[1] + (hi[1] - lo[1]) * (b - lo[0]) / (hi[0] - lo[0])) / 1e3

    if draft_ms is None:
        draft_ms = drafting_ms / drafted if drafted else 0.0
    k, rate = best_draft_length(alphas, draft_ms / 1e3, verify_s)
    plain = 1.0 / verify_s(1)
    return TuneResult(
        accept_by_pos=tuple(alphas), accept_rate=accepted / drafted if drafted else None,
        target_ms=verify[1], draft_ms=draft_ms, cost_ratio=draft_ms / verify[1], verify_ms=verify,
        recommended_draft_max=k, predicted_speedup=rate / plain, temp=temp, drafter=drafter,
        vocab_map=eng.vocab_translation, vocab_overlap=eng.vocab_overlap,
        alpha=accepted / tried if tried else None)


def ideal_speedup_table(alpha: float, cost_ratio: float, ks=(1, 2, 4, 8)) -> dict[int, float]:
    """BRIEF.md's ideal speed-up for a few k, for the printed summary (flat verify cost)."""
    return {k: ideal_speedup(alpha, k, cost_ratio) for k in ks}


def write_tuned(pair_dir, result: TuneResult):
    """Store the recommendation as [tuned] in DIR/specq-pair.toml (other tables kept as they are)."""
    import tomllib
    from pathlib import Path

    from ...manifest import MANIFEST_NAME, dumps, load_pair
    from ...atomic import atomic_output

    load_pair(pair_dir, verify=False, hint=False)  # the usual checks for a missing or bad manifest
    path = Path(pair_dir) / MANIFEST_NAME
    doc = tomllib.loads(path.read_text(encoding="utf-8"))
    doc["tuned"] = result.manifest_table()
    with atomic_output(path) as tmp:
        tmp.write_text(dumps(doc), encoding="utf-8")
    return path
