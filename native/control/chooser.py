"""The drafter chooser (--drafter auto): each step, the drafter (or plain decoding) and the length."""

from __future__ import annotations

from dataclasses import replace
from typing import Collection

from .explore import ProbeSchedule, doubled
from .length import LengthController, AdaptiveSnapshot
from .step import Choice, Handover, StepOutcome

RUN_EMA = 0.3  # the weight of a drafter's latest run of steps in its runs' mean length (DrafterChooser._owed)


class DrafterChooser:
    """--drafter auto: each step, the drafter (or plain decoding) and the length with the most expected tokens
    per second. One LengthController per drafter holds its acceptance by position and its drafting costs; a shared
    one (`shared`) holds what every step measures alike: the verify cost by batch size (its TargetCosts, which
    every drafter's controller holds by reference), the per-step overhead and the exploration budget. While
    plain decoding wins, a short probe of the drafter tried least recently runs every `probe_interval` steps
    (doubling while probes keep failing), so that a drafter whose estimate went stale can come back. Probes and
    explorations (another drafter tried in the best one's place) are paid from one exploration budget, each priced
    against what it displaces: a plain token, or the best drafter's tokens at its rate.

    `model`: the drafter that drafts with the draft model (the prefill's draft timings and prompt agreement are
    its); `memoryless`: drafters with no memory of the text, so nothing to catch up on (n-gram lookup).

    Evidence keys: a memoryless drafter may say, each step, what kind of proposal it has now (Drafter.evidence: the
    suffix drafter, how long its match is and where from). Its acceptance is then learnt per key, in a controller
    of its own (`keyed`; the drafter's pooled one learns every step too): a copy found by a 20-token match is
    accepted far more often than a 3-token match's guess, and one pooled estimate prices both alike."""

    def __init__(self, cap: int, cost_ratio_priors: dict[str, float], probe_min: int = 16, probe_max: int = 64,
                 probe_k: int = 1, model: str | None = None, memoryless: Collection[str] = (), **kw):
        self.cap = cap
        self.model = model
        self.memoryless = frozenset(memoryless)
        self.shared = LengthController(cap, **kw)
        # one verify model (the target's cost does not depend on the drafter) and one account for all probes
        self._args = dict(probe_min=probe_min, probe_max=probe_max, probe_k=probe_k, target=self.shared.target,
                          budget=self.shared.budget, **kw)
        self.ratios = dict(cost_ratio_priors)
        self.per: dict[str, LengthController] = {
            name: LengthController(cap, cost_ratio_prior=ratio, **self._args) for name, ratio in self.ratios.items()}
        self.keyed: dict[tuple[str, str], LengthController] = {}  # (memoryless drafter, evidence key): see above
        self.keys: dict[str, str | None] = {}  # this step's evidence keys (choose)
        self.probe_min, self.probe_max, self.probe_k = probe_min, probe_max, probe_k
        self.schedule = ProbeSchedule(probe_min, probe_max, self.shared.schedule.probe_budget)
        self.n_plain_steps = 0
        self.n_probes = 0
        self.last_used = {name: 0 for name in self.per}
        self.behind = {name: 0 for name in self.per}  # tokens emitted since each drafter last drafted
        # drafters with a memory: the tokens each emitted in its current run of steps, and its runs' decayed mean
        self.run = {name: 0 for name in self.per if name not in self.memoryless}
        self.run_mean: dict[str, float | None] = dict.fromkeys(self.run)
        self.exploring: tuple[str, float] | None = None  # (drafter, the displaced pace in s a token): being tried
        self.explore_interval = {name: probe_min for name in self.per}  # see _explore
        self.n_steps = 0
        self.n_chosen = {name: 0 for name in self.per}
        self.n_charged = 0  # steps chosen with a drafter's catch-up charged to the others (see choose)

    def at(self, n_ctx: int, remaining: int | None = None) -> None:
        """The next steps run at a context of n_ctx tokens (LengthController.at, for every drafter)."""
        for c in (self.shared, *self.per.values(), *self.keyed.values()):
            c.at(n_ctx, remaining)

    def calibration_points(self, first: int, last: int, with_draft: bool) -> list[tuple[int, int]]:
        return self.shared.calibration_points(first, last, with_draft)

    def calibrate(self, n_ctx: int, target_s: float, draft_token_s: float | None, n_tokens: int = 1) -> None:
        """A prefill's timing at n_ctx: the target's for all, the draft model's for its drafter."""
        self.shared.calibrate(n_ctx, target_s, None, n_tokens)
        if draft_token_s is not None and self.model in self.per:
            self.per[self.model].calibrate(n_ctx, target_s, draft_token_s, n_tokens)

    def new_answer(self) -> None:
        """A generation starts (LengthController.new_answer), for every drafter; a drafter with a memory reads the
        prompt in its prefill, so none is behind. What a memoryless drafter (n-gram lookup) accepted at position 1
        was the last prompt's to copy from: weakened, or one answer's misses keep it out of the next one, where
        the model's runs (long in free text) hold it off (docs/benchmarks.md, "Copy-edit prompts: auto beside a
        useless and a good draft")."""
        for name, c in self.per.items():
            c.new_answer(copies=name in self.memoryless)
        for c in self.keyed.values():
            c.new_answer(copies=True)
        self.behind = dict.fromkeys(self.behind, 0)
        for name in self.run:
            self._end_run(name)

    def wants_agreement(self) -> bool:
        """Whether the draft model's prompt agreement would inform the next choice (LengthController's)."""
        return self.model in self.per and self.per[self.model].wants_agreement()

    def seed_acceptance(self, n_agree: int, n: int) -> None:
        """The draft model's prompt agreement (LengthController.seed_acceptance)."""
        self.per[self.model].seed_acceptance(n_agree, n)

    @property
    def n_seeds(self) -> int:
        return self.per[self.model].n_seeds if self.model in self.per else 0

    @property
    def n_calibrations(self) -> int:
        return self.shared.n_calibrations

    @property
    def n_batch_calibrations(self) -> int:
        return self.shared.n_batch_calibrations

    @property
    def probe_interval(self) -> int:
        """Plain steps between probes while plain decoding wins (doubling while they fail)."""
        return self.schedule.interval

    @property
    def overhead(self) -> float:
        """The per-step overhead, as measured over every step."""
        return self.shared.overhead

    def _ctl(self, name: str) -> LengthController:
        """The controller that prices a drafter's proposal this step: its evidence key's, where it gave one."""
        key = self.keys.get(name)
        if key is None or name not in self.memoryless:
            return self.per[name]
        c = self.keyed.get((name, key))
        if c is None:
            c = self.keyed[(name, key)] = LengthController(self.cap, cost_ratio_prior=self.ratios[name], **self._args)
            c.at(self.shared.n_ctx, self.shared.remaining)
        return c

    def _best(self, name: str, limit: int, per_token: float = 0.0, pooled: bool = False) -> tuple[int, float]:
        """A drafter's best (k, tokens/s) within `limit` and its reach, on the shared verify cost and overhead (by
        its evidence key's acceptance, or `pooled`)."""
        c = self.per[name] if pooled else self._ctl(name)
        return c.near_best(min(limit, self.cap), self.shared.overhead, per_token)

    def _owed(self, name: str) -> float:
        """Seconds a token: the catch-up a drafter with a memory of the text owes on what others emitted since it
        last drafted, spread over the tokens it is expected to emit before it falls behind again (its runs' mean
        length, at most the tokens still to come). A catch-up is a prefill of the draft (after a long n-gram copy
        it costs as much as several plain tokens): in copied text, where the model drafts a step at
        each edit before n-grams take over again, it rarely pays; in free text, where the model runs on, it does."""
        if name in self.memoryless or self.behind[name] == 0:
            return 0.0
        mean = self.run_mean[name]
        horizon = self.shared.remaining if mean is None else min(mean, self.shared.remaining)
        return self.behind[name] * self.per[name].catchup_s() / max(horizon, 1)

    def _end_run(self, name: str) -> None:
        """A drafter's run of steps ended (another drafted, plain decoding, the answer's end): its length counts."""
        n, self.run[name] = self.run[name], 0
        if n:
            mean = self.run_mean[name]
            self.run_mean[name] = float(n) if mean is None else mean + RUN_EMA * (n - mean)

    def choose(self, limits: dict[str, int], keys: dict[str, str | None] | None = None) -> Choice:
        """The drafter and draft length for the next step (Choice(None, 0): plain decoding); limits: the most each
        available drafter may draft now (an n-gram proposal is only as long as what followed its match); keys: their
        evidence keys (see the class's docstring).

        A drafter with a memory of the text (a draft model, an MTP head) must later decode every token emitted
        without it: while it would beat plain decoding, each token another drafter or plain decoding emits is
        charged its catch-up cost (catchup_s), so that a cheap n-gram step is not taken for free when it only
        moves work to the model's next step. Its own price carries the catch-up it owes so far, spread over the
        tokens to come (_owed): near an answer's end, after a long copy, it loses to plain decoding and nothing more
        is charged."""
        self.n_steps += 1
        self.keys = dict(keys or {})
        sh = self.shared
        owed = {name: self._owed(name) for name, limit in limits.items() if limit > 0}
        own = {name: self._best(name, limits[name], owed[name]) for name in owed}
        plain = 1.0 / (sh.verify_s(1) + sh.overhead)
        # the drafters that would be used (they beat plain decoding) and keep a memory to catch up
        keep = {n: self.per[n].catchup_s() for n, (k, r) in own.items()
                if k > 0 and r > plain and n not in self.memoryless}
        best, best_k, best_rate = None, 0, 1.0 / (sh.verify_s(1) + sh.overhead + sum(keep.values()))
        for name, (k, rate) in own.items():
            charge = sum(v for n, v in keep.items() if n != name)
            if charge > 0 and k > 0:
                k, rate = self._best(name, limits[name], per_token=charge + owed[name])
            if k > 0 and rate > best_rate:
                best, best_k, best_rate = name, k, rate
        if keep:
            self.n_charged += 1
        if best is not None:
            return self._draft(best, best_k, 1.0 / best_rate, limits)
        return self._plain_or_probe(limits)

    def _draft(self, best: str, best_k: int, pace_s: float, limits: dict[str, int]) -> Choice:
        """Drafting wins this step (the best drafter's tokens cost pace_s each): the best drafter's, unless another
        is due to be explored (_explore)."""
        self.schedule.drafting()
        self.explore_interval[best] = self.probe_min
        self._ctl(best).chosen()
        other = self._explore(best, pace_s, limits)
        if other is not None:
            lim = min(limits[other], self.cap)
            k, _ = self._best(other, lim)
            self.n_probes += 1
            self.exploring = (other, pace_s)
            return Choice(self._use(other), max(k, min(self.probe_k, lim)))
        return Choice(self._use(best), best_k, lambda: self._handover(best, pace_s, limits))

    def _handover(self, best: str, pace_s: float, limits: dict[str, int]) -> Handover | None:
        """Where a drafter with a memory (a draft model) should stop drafting this step: once a memoryless drafter
        (n-gram lookup) would propose enough tokens after its drafts to beat its pace (the fewest such, priced
        with the model's catch-up as choose prices it then). In copy-edited text the model is chosen at an edit,
        where no n-gram matches, and a lookup matches again a token or two later: drafting on through the copied
        stretch at its own pace loses to the lookup's long, nearly free copies."""
        if best in self.memoryless:
            return None
        charge = self.per[best].catchup_s()
        for name in sorted(self.memoryless & self.per.keys()):
            if name in limits:
                for least in range(1, self.cap + 1):
                    k, rate = self._best(name, least, charge, pooled=True)
                    if k > 0 and rate * pace_s > 1.0:
                        return Handover(name, least)
        return None

    def _plain_or_probe(self, limits: dict[str, int]) -> Choice:
        """Plain decoding wins this step: a probe of a drafter whose turn it is, else plain decoding.

        A drafter tried too few times yet is probed every other step while the probes pay for themselves, and
        spaced by their measured cost when they do not (LengthController.min_evidence, thin_gap); the others every
        probe_interval steps (or the drafter's own, longer when its probes cost more than probe_budget)."""
        self.schedule.plain_step()
        streak = self.schedule.plain_streak
        due = [n for n, lim in limits.items() if lim > 0 and self._ctl(n).could_pay(min(lim, self.cap))
               and streak > self._ctl(n).probe_gap(self.schedule.interval)
               and self._ctl(n).may_probe(self.behind[n])]
        if due:
            name = min(due, key=lambda n: self.last_used[n])
            self.schedule.probe(self._ctl(name).thin_evidence())
            self._ctl(name).mark_probe()
            self.n_probes += 1
            return Choice(self._use(name), min(self.probe_k, limits[name], self.cap))
        self.n_plain_steps += 1
        return Choice(None, 0)

    def _explore(self, best: str, pace_s: float, limits: dict[str, int]) -> str | None:
        """Another drafter to try this step instead of the best one, so that a drafter's estimate is not
        frozen by one unlucky try while another wins every step (the text may change: a prompt to copy from
        makes n-grams pay): one with a proposal now that was tried too few times yet (every other step), or
        one not used for its exploration interval, which doubles up to probe_max while it keeps losing; either
        only where the exploration budget has room for its expected loss against the best drafter's tokens
        (pace_s each: a useless draft model tried in place of long n-gram copies loses most of a step)."""
        for name, lim in limits.items():
            if name == best or lim <= 0:
                continue
            c = self._ctl(name)
            since = self.n_steps - self.last_used[name]
            due = since >= 2 if c.thin_evidence() else since > self.explore_interval[name]
            if due and c.could_pay(min(lim, self.cap)) and c.may_probe(self.behind[name], pace_s):
                if not c.thin_evidence():
                    self.explore_interval[name] = doubled(self.explore_interval[name], self.probe_max)
                return name
        return None

    def _use(self, name: str) -> str:
        self.last_used[name] = self.n_steps
        self.n_chosen[name] += 1
        return name

    def observe(self, step: StepOutcome) -> None:
        """Record one step (step.drafter None: plain decoding): the verify and overhead for all, the acceptance and
        drafting costs for the drafter that drafted."""
        self.shared.observe(replace(step, draft_token_s=None, first_token_s=None, catchup=None))
        if step.drafter is not None and step.n_drafted:
            self.per[step.drafter].observe(step)
            keyed = self._ctl(step.drafter)
            if keyed is not self.per[step.drafter]:
                keyed.observe(step)
        explored, self.exploring = self.exploring, None
        if explored is not None and explored[0] == step.drafter and not step.shared:
            # an exploration's measured loss against the displaced drafter's tokens (a gain pays back)
            self.shared.budget.spent_s += step.step_s - (step.expected_accepted + 1) * explored[1]
        for name in self.behind:
            if name == step.drafter and step.n_drafted:
                self.behind[name] = 0
                if name in self.run:
                    self.run[name] += step.n_accepted + 1
            else:
                self.behind[name] += step.n_accepted + 1
                if name in self.run:
                    self._end_run(name)

    def snapshot(self, limit: int | None = None) -> AdaptiveSnapshot:
        """The snapshot of the drafter chosen most often (costs and plain steps as measured for all)."""
        name = max(self.n_chosen, key=lambda n: self.n_chosen[n]) if self.per else None
        snap = (self.per[name] if name else self.shared).snapshot(limit)
        return replace(snap, verify_ms={b: v * 1e3 for b, v in sorted(self.shared.v_mean.items())},
                       overhead_ms=self.shared.overhead * 1e3, n_calibrations=self.shared.n_calibrations,
                       n_plain_steps=self.n_plain_steps, n_probes=self.n_probes)
