"""Generations on several sequences of one engine (Engine(parallel=N), a Session each), stepped together: each
step is runtime/step.py's one step over every live sequence, with the batch's draft lengths (control/batch_plan.py).
The rewind is each generation's own (`Generation.take`), one sequence at a time (`seq_rm` on its sequence id).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..control.batch_plan import BatchPlanner, Wish
from ..control.chooser import DrafterChooser
from ..core.memory import extend_grouped
from ..core.stats import TokenEvent
from ..drafters.base import CATCHUP_SHORT
from . import step as speculative
from .step import Ask

if TYPE_CHECKING:
    from ..control.length import LengthController
    from .generation import Generation


def _length_controller(g: Generation, drafter: str | None) -> LengthController | None:
    """The length controller that speaks for a generation's drafts (under --drafter auto its drafter's)."""
    ctrl = g.controller
    if isinstance(ctrl, DrafterChooser):
        return ctrl.per.get(drafter) if drafter else None
    return ctrl


def wish(g: Generation, plan: tuple[int, tuple[str, ...] | None]) -> Wish:
    """A generation's part of a batched step for the planner: how far it may draft, whether the planner chooses
    that length (draft_max auto: up to the step's room, whatever its own controller chose on costs measured alone,
    which a shared step does not have; under --drafter auto only where its chooser picked a drafter), whether its
    drafter decodes (a draft model), its acceptance by position."""
    k, drafters = plan
    ses = g.session
    if g.settings.adaptive and g.controller is not None and drafters != ():
        k = g.draft_limit if not isinstance(g.controller, DrafterChooser) else k
    names = ses.available_drafters(g.settings) if drafters is None else drafters
    d = ses.drafters.get(names[0]) if names and k > 0 else None
    decodes = d is not None and not d.on_match_only
    behind = d.behind() if decodes else 1
    ctrl = _length_controller(g, names[0] if names else None)
    if g.settings.adaptive and ctrl is not None:
        return Wish(k, True, decodes, alphas=ctrl.alphas(), behind=behind)
    return Wish(k, False, decodes, tokens=len(g.tokens) / max(g.n_steps, 1), behind=behind)


class Batch:
    """Generations on different sequences of one engine, stepped together: `add` evaluates a prompt, `step`
    advances every live generation by one speculative step and returns each one's tokens; a generation that has
    ended leaves the batch (its `stats` set) at the next step."""

    def __init__(self, planner: BatchPlanner | None = None) -> None:
        """`planner`: the batch's draft lengths (control/batch_plan.py; a new one by default). Batch(planner=None)
        with `plan_lengths = False` keeps each sequence's own length (benchmarks compare the two)."""
        self.live: list[Generation] = []
        self.n_steps = 0  # batched steps run
        self.most_in_a_step = 0  # the most sequences one step carried
        self.planner = BatchPlanner() if planner is None else planner
        self.plan_lengths = True
        self.n_unprepared = 0  # joiners whose drafts were left alone
        self.n_lone_plain = 0  # steps of an unprepared sequence alone, kept plain (_alone)
        self.n_deferred_reads = 0  # prompt reads left to a catch-up while requests waited to join (delivered)
        self.n_first_plain = 0  # drafts kept for later beside another's first token (_first_tokens_first)
        self.n_joined_prompts = 0  # prompts evaluated in one decode with another's (add_all)
        self._stepped: list[Generation] = []  # the last step's generations, until delivered()

    def add(self, gen: Generation) -> None:
        """Evaluate a generation's prompt and make it live (add_all of one)."""
        failed = self.add_all([gen])
        if failed:
            raise failed[0][1]

    def add_all(self, gens: list[Generation]) -> list[tuple[Generation, Exception]]:
        """Evaluate several generations' prompts and make them live; those that could not start, with why (the
        others go on). In one unified cache the prompts' untimed ends are evaluated together, in as few decodes
        as the batch size allows (one pass of several prompts costs less than one each on the CPU); a failure of
        that decode is raised, nothing joined (a prompt alone is its own: folded where it steps alone,
        Generation.start). With a stream per sequence llama.cpp splits prompts of different
        lengths into many small passes, which gain nothing: one decode each there (docs/benchmarks.md, "serve
        --parallel on an AMX Xeon").

        Each draft is got ready (calibration timings, prompt agreement, and after the first token the prompt
        read) where it may run alone (an empty batch, unless the load that made the batch stop drafting is likely
        still there: BatchPlanner.settled_plain), where the batch drafts, and — while the batch knows nothing of
        the draft's cost — for one sequence, whose timings price it; else the draft reads the prompt as a
        catch-up when the batch first lets it draft (at high load maybe never)."""
        pl, started, failed = self.planner, [], []
        joined: list | None = [] if len(gens) > 1 and gens[0].session.engine.tgt_ctx.unified else None
        for gen in gens:
            others = self.live + started
            if gen.session.seq in {g.session.seq for g in others}:
                failed.append((gen, ValueError(f"sequence {gen.session.seq} already runs a generation in this "
                                               "batch")))
                continue
            prepare = not pl.settled_plain and (not others or pl.drafting) \
                or not pl.knows_draft and not any(g.prepared for g in others)
            n_joined = len(joined or ())
            try:
                gen.start(prepare=prepare, joined=joined, alone=not others)
            except Exception as e:  # noqa: BLE001 - this prompt fails (too long, empty), the others go on
                if joined:
                    del joined[n_joined:]
                failed.append((gen, e))
                continue
            self.n_unprepared += not prepare
            started.append(gen)
        if started and joined is not None:
            clock = started[0].session.engine.clock
            t0 = clock()
            self.n_joined_prompts += extend_grouped(joined, started[0].session.engine.tgt_ctx.n_batch)
            seconds = clock() - t0
            for gen in started:
                gen.joined_prefill(seconds)
        self.live += started
        return failed

    def step(self, read_now: bool = True) -> list[tuple[Generation, list[TokenEvent]]]:
        """One step of every live generation: (generation, its new tokens) each. A generation whose step ended it
        (or that could not step: n_predict, a full context) leaves the batch with its stats final. `read_now`
        False: the caller sends the tokens first, then calls delivered()."""
        out, going, plans = [], [], []
        for g in self.live:
            plan = g.next_step()
            if plan is None:
                g.conclude()
                out.append((g, []))
            else:
                going.append(g)
                plans.append(plan)
        self.live = going
        if going:
            clock = going[0].session.engine.clock
            t0 = clock()
            wishes = [wish(g, plan) for g, plan in zip(going, plans)] if len(going) > 1 else []
            if not wishes:
                plans = self._alone(going[0], plans)
            if wishes and self.plan_lengths:
                plans = self._cap(going, wishes, plans)
            if wishes:
                plans = self._first_tokens_first(going, wishes, plans)
            tgt = going[0].session.engine.tgt_ctx
            pads0 = tgt.n_padding_rows
            results = speculative.step([Ask(g.session, g.settings, g.sampling, *plan) for g, plan in zip(going, plans)])
            self.n_steps += 1
            self.most_in_a_step = max(self.most_in_a_step, len(going))
            out += [(g, g.take(r)) for g, r in zip(going, results)]
            if wishes:
                r = results[0]
                loop_s = max(((x.draft_token_s or 0.0) * (x.n_drafted - 1) for x in results), default=0.0)
                self.planner.observe(wishes, [x.n_drafted for x in results], [len(x.emitted) for x in results],
                                     r.draft_s, r.verify_s, clock() - t0 - r.draft_s - r.verify_s, loop_s,
                                     padding=tgt.n_padding_rows - pads0)
            self._stepped = list(going)
            for g in going:
                if g.ended:  # it leaves at once: its stats are final, its sequence free
                    self.live.remove(g)
                    g.conclude()
            if read_now:
                self.delivered()
        return out

    def delivered(self, defer: bool = False) -> None:
        """The last step's tokens are out (step(read_now=False): sent to the clients): a first token is out, so a
        prepared draft reads its prompt now, off the path to that token (Generation.after_delivery). `defer`:
        requests wait to join (a server's queue), whose first tokens the read would hold back: the draft catches
        up instead when the batch first lets it draft, and not in a step that gives another its first token."""
        going, self._stepped = self._stepped, []
        for g in going:
            if g in self.live:
                read = g.prepared or self.planner.drafting or len(going) == 1 and not self.planner.settled_plain
                if read and defer and g.read_pending:
                    read = False
                    self.n_deferred_reads += 1
                g.after_delivery(read=read)

    def _first_tokens_first(self, going: list[Generation], wishes: list[Wish], plans: list) -> list:
        """A step that gives a sequence its first token drafts nothing for a sequence whose draft must first read
        a long way (a prompt read deferred, or plain steps since it last drafted): that catch-up would hold the
        first token back; it drafts at a later step."""
        if not any(g.n_steps == 0 for g in going):
            return plans
        out = []
        for w, (k, drafters) in zip(wishes, plans):
            if k > 0 and w.decodes and w.behind > CATCHUP_SHORT:
                k = 0
                self.n_first_plain += 1
            out.append((k, drafters))
        return out

    def _alone(self, g: Generation, plans: list) -> list:
        """A sequence stepping alone: its own plan, or plain decoding while its draft was never got ready and the
        batch's plain verdict still holds (a draft model would first read all of its text, for a few steps before
        the next request joins)."""
        self.planner.alone()
        if not g.prepared and self.planner.settled_plain:
            self.n_lone_plain += 1
            return [(0, plans[0][1])]
        return plans

    def _cap(self, going: list[Generation], wishes: list[Wish], plans: list) -> list:
        """The batch's draft lengths (control/batch_plan.py), seeded with a sequence's own measured costs."""
        pl = self.planner
        pl.at(sum(len(g.session.history) for g in going) // len(going))
        for g, w in zip(going, wishes):
            ctrl = _length_controller(g, None)
            if w.adaptive and ctrl is not None:
                timed = ctrl.t_first if ctrl.t_first is not None else ctrl.t_draft
                pl.seed(ctrl.target.band.v_mean, ctrl.draft.ratio_prior, timed, pl.verify.n_ctx,
                        ctrl.draft_rows)  # (until measured)
                break
        ks = pl.plan(wishes)
        return [(k, drafters) for k, (_, drafters) in zip(ks, plans)]

    def cancel(self, gen: Generation) -> None:
        """End a generation now, between steps (its memories rewound to its history)."""
        self.live.remove(gen)
        gen.conclude()

    def run(self) -> None:
        """Step until every generation has ended."""
        while self.live:
            self.step()
