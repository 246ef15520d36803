"""The drafter interface (native/drafters/base.py) and its one extension point, the registry: two drafters defined
and registered here, in the test alone, run through `specq bench`, served requests on two sequences at once and
--drafter auto, and the output is the target's own (greedy), whatever they propose.

- `ScratchDrafter` needs an engine resource of its own: a second, small context of the target model that it
  declares (`provide`), one per engine, a sequence of it per session.
- `RecallDrafter` keeps a store across requests (`provide`, filled by the `ended` hook): it proposes what followed
  the text's last two tokens in earlier answers, never in the current text.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specq.cli.app import app
from specq.native.core.memory import Memory, common_prefix
from specq.native.core.settings import GenerationSettings
from specq.native.drafters import registry
from specq.native.drafters.base import Drafter, Proposal, pick, pick_loop
from specq.native.drafters.ngram import point_mass
from specq.native.llama import ffi

SCRATCH_CTX = 128  # the scratch drafter's own context: smaller than any engine's here


class ScratchDrafter(Drafter):
    """Proposes the target's own greedy continuation from a small context of the target's weights that the engine
    opens for it, with the last token of every proposal of 3 or more made wrong so that the verify rejects some.
    A drafter of the same model costs what the target does: it reports no costs (as the n-gram lookup does), so
    that --drafter auto prices it at its prior."""

    name = "scratch"
    opened: list = []  # every context provided, in order
    n_proposed = 0  # tokens proposed, every instance

    @classmethod
    def provide(cls, engine):
        c = ffi.Context(engine.target, SCRATCH_CTX, engine.threads, n_batch=64, name="draft", n_seq=engine.parallel)
        cls.opened.append(c)
        return c

    def __init__(self, session):
        super().__init__(session)
        ctx = self.shared if session.engine.parallel == 1 else self.shared.seq(session.seq)
        self.mem = Memory(ctx)

    def propose(self, n_max: int, s: GenerationSettings, samp) -> Proposal:
        hist, mem = self.session.history, self.mem
        n_max = min(n_max, SCRATCH_CTX - len(hist) - 1)
        if n_max < 1:
            return Proposal()
        mem.truncate(min(common_prefix(mem.tokens, hist), len(hist) - 1))
        mem.extend(hist[len(mem.tokens):], logits="last")
        eng = self.session.engine
        drafts, dists = pick_loop(
            lambda d: pick(samp.draft_row(mem.ctx.logits(1)[0], d), s.p_min, samp, eng.target.n_vocab, eng.clock),
            lambda tok, i: mem.extend([tok], logits="last"), n_max)
        if len(drafts) >= 3 and samp.draft_tf is None:  # (greedy: a sampled token must be its dist's)
            drafts[-1] = (drafts[-1] + 1) % self.session.engine.target.n_vocab
        ScratchDrafter.n_proposed += len(drafts)
        return Proposal(drafts, dists)

    def rewind(self) -> None:
        self.mem.truncate(common_prefix(self.mem.tokens, self.session.history))

    def clear(self) -> None:
        self.mem.clear()


class Answers:
    """The recall drafter's store on one engine: every answer its sessions produced."""

    def __init__(self):
        self.answers: list[list[int]] = []


class RecallDrafter(Drafter):
    """Proposes what followed the history's last two tokens in the latest earlier answer that has them (the
    engine's store, shared by every sequence and request), nothing from the history itself."""

    name = "recall"
    on_match_only = True
    has_memory = False
    stores: list[Answers] = []
    n_unseen = 0  # tokens proposed that the history did not hold when proposed

    @classmethod
    def provide(cls, engine):
        cls.stores.append(Answers())
        return cls.stores[-1]

    def propose(self, n_max: int, s: GenerationSettings, samp) -> Proposal:
        hist = self.session.history
        key = hist[-2:]
        for ans in reversed(self.shared.answers):
            for i in range(len(ans) - 2, -1, -1):
                if ans[i:i + 2] == key and i + 2 < len(ans):
                    drafts = ans[i + 2:i + 2 + n_max]
                    RecallDrafter.n_unseen += sum(t not in hist for t in drafts)
                    return Proposal(drafts, [point_mass(t) for t in drafts] if samp.draft_tf is not None else [])
        return Proposal()

    def ended(self, prompt: list[int], output: list[int], interrupted: bool) -> None:
        if not interrupted and len(output) > 2:
            self.shared.answers.append(list(self.session.history[-len(output) - 2:]))


@pytest.fixture
def toys():
    for cls in (ScratchDrafter, RecallDrafter):
        registry.register(cls)
    ScratchDrafter.n_proposed = RecallDrafter.n_unseen = 0
    ScratchDrafter.opened.clear()
    RecallDrafter.stores.clear()
    try:
        yield
    finally:
        for cls in (ScratchDrafter, RecallDrafter):
            registry.unregister(cls.name)


def bench(tiny_target, *args) -> dict:
    r = CliRunner().invoke(app, ["bench", "--target", str(tiny_target), "--threads", "1", "--ctx", "256",
                                 "--n-predict", "24", "--prompt", "The quick brown fox", "--json", "-", "-q", *args])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def spec_run(doc: dict) -> dict:
    assert doc["summary"]["identical_output"] is True
    base = next(x for x in doc["runs"] if x["mode"] == "baseline")
    assert len(set(base["tokens"])) > 3  # not one token repeated
    return next(x for x in doc["runs"] if x["mode"] == "speculative")


def test_a_drafter_with_its_own_engine_resource_runs_through_bench_exactly(toys, tiny_target):
    doc = bench(tiny_target, "--drafter", "scratch", "--draft-max", "4")
    spec = spec_run(doc)
    assert doc["settings"]["drafter"] == "scratch" and doc["draft"] is None
    assert spec["n_drafted_by"]["scratch"] == spec["n_drafted"] > 0 and 0 < spec["n_accepted"] < spec["n_drafted"]
    assert ScratchDrafter.n_proposed > 0
    assert len(ScratchDrafter.opened) == 1 and ScratchDrafter.opened[0].n_decode_calls > 0  # the engine's, used


def test_a_drafter_with_a_store_drafts_from_an_earlier_answer_in_bench(toys, tiny_target):
    """bench runs the target alone, then speculative: the store holds the first answer, and the speculative run
    drafts tokens its own text did not hold yet (the same greedy answer)."""
    doc = bench(tiny_target, "--drafter", "recall", "--draft-max", "4")
    spec = spec_run(doc)
    assert spec["n_drafted_by"]["recall"] == spec["n_drafted"] > 0 and spec["n_accepted"] > 0
    assert RecallDrafter.n_unseen > 0 and len(RecallDrafter.stores) == 1


def test_drafter_auto_considers_both_registered_drafters(toys, tiny_target):
    """Answers under --drafter auto on a simulated clock (what auto picks depends on the modelled costs, not on
    how busy the machine is), the scratch drafter priced as what it is, the target's weights (a draft decode costs
    a target decode): the target alone's answer fills the recall store, auto tries recall beside scratch; both toys
    draft and every answer is the target's own."""
    from specq.native.runtime.engine import Engine, SimulatedClock
    from test_adaptive import cpu_like_costs

    clock = SimulatedClock(cpu_like_costs(target_one_ms=10.0, draft_ms=10.0))
    drafted: dict[str, int] = {}
    with Engine(tiny_target, ctx=256, threads=1, clock=clock) as e:
        toks = e.tokenize("The quick brown fox")
        base = e.session().generate(toks, GenerationSettings(n_predict=48), speculative=False).run()
        assert len(set(base.tokens)) > 3
        for _ in range(3):
            g = e.session().generate(toks, GenerationSettings(n_predict=48, drafter="auto")).run()
            assert g.tokens == base.tokens
            for name, n in g.stats.n_drafted_by:
                drafted[name] = drafted.get(name, 0) + n
    assert clock.n_decodes > 0
    assert drafted.get("scratch", 0) > 0 and drafted.get("recall", 0) > 0, drafted


def test_an_unregistered_drafter_is_one_actionable_error(tiny_target):
    r = CliRunner().invoke(app, ["bench", "--target", str(tiny_target), "--drafter", "scratch"])
    assert r.exit_code != 0 and "--drafter must be" in r.stderr and "scratch" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_drafter_in_other_units_is_refused_at_registration():
    class Other(RecallDrafter):
        name = "other-units"
        units = "draft-vocabulary"

    with pytest.raises(ValueError, match="target's token ids"):
        registry.register(Other)


def test_both_drafters_serve_two_sequences_at_once_exactly(toys, tiny_target):
    """Through the serving layer with --parallel 2 (its app in this process: a subprocess cannot see drafters
    registered here): the target alone answers first (and fills the recall store), then two requests per drafter
    run at once, one engine resource and one store shared by both sequences."""
    pytest.importorskip("prometheus_client")
    from serve_proc import serve_in_process
    from specq.native.runtime.config import EngineConfig

    prompt = {"prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0}
    answers = serve_in_process(EngineConfig(str(tiny_target), None, ctx=256, threads=1, parallel=2),
                               [{**prompt, "drafter": name, "draft_max": 4}
                                for name in ("scratch", "scratch", "recall", "recall")],
                               GenerationSettings(n_predict=24), concurrent=True, before=[{**prompt, "draft_max": 0}])
    assert [status for status, _ in answers] == [200] * 5, answers
    alone, *docs = (json.loads(body) for _, body in answers)
    assert len(set(alone["choices"][0]["text"])) > 3
    for doc in docs:
        assert doc["choices"][0]["text"] == alone["choices"][0]["text"]
        spec = doc["usage"]["speculative"]
        assert spec["n_drafted"] > 0 and spec["n_accepted"] > 0, spec
    assert len(ScratchDrafter.opened) == 1 and len(RecallDrafter.stores) == 1
    assert ScratchDrafter.n_proposed > 0 and RecallDrafter.n_unseen > 0
