"""A generation stepped beside another sequence: the one-sequence tests' twins run their generation on sequence 1
of an Engine(parallel=2) while a speculative neighbour on sequence 0 shares every step of it, so that each rule of
the speculative step (runtime/step.py) is checked on its batched path too (benchmarks/mutations.py)."""

from __future__ import annotations

from specq.native.runtime import step as speculative
from specq.native.runtime.batch import Batch
from specq.native.runtime.generation import Generation
from specq.native.core.settings import GenerationSettings

NEIGHBOUR = "Once upon a time, there"  # the tiny target runs 200 greedy tokens on from it without an EOG


class Pair:
    """A batch of two: `g` (the generation under test, sequence 1) and a neighbour on sequence 0 that outlives it
    (it drafts one token a step, so it emits at most two, for twice `g`'s tokens and more), so that every step of
    `g` is a shared one."""

    def __init__(self, e, prompt: list[int], settings: GenerationSettings, neighbour: str = NEIGHBOUR):
        n = 2 * (settings.n_predict or 64) + 32
        self.engine = e
        self.other = e.session(0).generate(e.tokenize(neighbour), GenerationSettings(n_predict=n, draft_max=1,
                                                                                     drafter=settings.drafter))
        self.g = e.session(1).generate(prompt, settings)
        self.batch = Batch()
        self.batch.add(self.other)
        self.batch.add(self.g)
        self.multi0 = e.tgt_ctx.n_multi_decodes

    def step(self) -> list:
        """One step of both: `g`'s new tokens."""
        return [ev for x, evs in self.batch.step() if x is self.g for ev in evs]

    def run(self) -> Generation:
        """Step until `g` ends; the neighbour was beside it all along."""
        while self.g in self.batch.live:
            self.step()
        self.check_shared()
        return self.g

    def check_shared(self) -> None:
        assert self.engine.tgt_ctx.n_multi_decodes > self.multi0  # verifies of both sequences in one decode
        assert self.other in self.batch.live  # the neighbour outlived it: every step of `g` was shared


def beside(e, prompt: list[int], settings: GenerationSettings, neighbour: str = NEIGHBOUR) -> Generation:
    """`settings`' generation of `prompt` on sequence 1, every step shared with a neighbour on sequence 0."""
    return Pair(e, prompt, settings, neighbour).run()


def spy_steps(monkeypatch, seq: int) -> list[tuple[int, int]]:
    """Each step of sequence `seq` as the speculative step returned it: (tokens drafted and verified, emitted)."""
    seen, real = [], speculative.step

    def spy(asks):
        steps = real(asks)
        seen.extend((s.n_drafted, len(s.emitted)) for a, s in zip(asks, steps) if a.session.seq == seq)
        return steps

    monkeypatch.setattr(speculative, "step", spy)
    return seen


def draft_memory(ses):
    """A session's draft-model memory (the model drafter's)."""
    return ses.drafters["model"].memory
