"""The drafter interface (native/drafters/base.py) and its one extension point, the registry: a drafter defined and
registered here, in the test alone, runs through `specq bench`, a served request and --drafter auto, and the
output is the target's own (greedy), whatever it proposes."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specq.cli.app import app
from specq.native.runtime.engine import Engine
from specq.native.core.memory import Memory, common_prefix
from specq.native.core.settings import GenerationSettings
from specq.native.drafters import registry
from specq.native.drafters.base import Drafter, Proposal, pick_loop


class ToyDrafter(Drafter):
    """Proposes the target's own greedy continuation, from a second Engine of the target that it loads on first
    use (on the thread that drives the session), with the last token of every proposal of 3 or more made wrong so
    that the verify rejects some (greedy decoding). A drafter of the same model costs what the target does: it reports no costs
    (as the n-gram lookup does), so that --drafter auto prices it at its prior."""

    name = "toy"
    engines: list[Engine] = []  # every second engine loaded, closed by the fixture
    n_proposed = 0  # tokens proposed, every instance

    def __init__(self, session):
        super().__init__(session)
        self.ref: Engine | None = None
        self.mem = None

    def propose(self, n_max: int, s: GenerationSettings, samp) -> Proposal:
        hist = self.session.history
        if self.ref is None:
            self.ref = Engine(self.session.engine.target.path, ctx=self.session.n_ctx, threads=1)
            ToyDrafter.engines.append(self.ref)
            self.mem = Memory(self.ref.tgt_ctx)
        mem, clock = self.mem, self.session.engine.clock
        mem.truncate(min(common_prefix(mem.tokens, hist), len(hist) - 1))
        mem.extend(hist[len(mem.tokens):], logits="last")
        drafts, dists = pick_loop(lambda: mem.ctx.logits(1)[0], lambda tok, i: mem.extend([tok], logits="last"),
                                  n_max, s.p_min, samp, self.ref.target.n_vocab, clock)
        if len(drafts) >= 3 and samp.draft_tf is None:  # (greedy: a sampled token must be its dist's)
            drafts[-1] = (drafts[-1] + 1) % self.ref.target.n_vocab
        ToyDrafter.n_proposed += len(drafts)
        return Proposal(drafts, dists)

    def rewind(self) -> None:
        if self.mem is not None:
            self.mem.truncate(common_prefix(self.mem.tokens, self.session.history))

    def clear(self) -> None:
        if self.mem is not None:
            self.mem.clear()


@pytest.fixture
def toy():
    registry.register(ToyDrafter)
    ToyDrafter.n_proposed = 0
    try:
        yield ToyDrafter
    finally:
        registry.unregister(ToyDrafter.name)
        for e in ToyDrafter.engines:
            e.close()
        ToyDrafter.engines.clear()


def bench(tiny_target, *args) -> dict:
    r = CliRunner().invoke(app, ["bench", "--target", str(tiny_target), "--threads", "1", "--ctx", "256",
                                 "--n-predict", "24", "--prompt", "The quick brown fox", "--json", "-", "-q", *args])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_a_registered_drafter_runs_through_bench_exactly(toy, tiny_target):
    doc = bench(tiny_target, "--drafter", "toy", "--draft-max", "4")
    spec = next(x for x in doc["runs"] if x["mode"] == "speculative")
    assert doc["settings"]["drafter"] == "toy" and doc["draft"] is None
    assert doc["summary"]["identical_output"] is True
    assert spec["n_drafted_by"]["toy"] == spec["n_drafted"] > 0 and spec["n_accepted"] > 0
    assert toy.n_proposed > 0


def test_drafter_auto_considers_a_registered_drafter(toy, tiny_target):
    doc = bench(tiny_target, "--drafter", "auto")
    spec = next(x for x in doc["runs"] if x["mode"] == "speculative")
    assert doc["summary"]["identical_output"] is True
    assert spec["n_drafted_by"].get("toy", 0) > 0


def test_an_unregistered_drafter_is_one_actionable_error(tiny_target):
    r = CliRunner().invoke(app, ["bench", "--target", str(tiny_target), "--drafter", "toy"])
    assert r.exit_code != 0 and "--drafter must be" in r.stderr and "toy" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_registered_drafter_serves_a_request_exactly(toy, tiny_target):
    pytest.importorskip("prometheus_client")
    from serve_proc import serve_in_process
    from specq.native.runtime.config import EngineConfig

    prompt = {"prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0}
    answers = serve_in_process(EngineConfig(str(tiny_target), None, ctx=512, threads=1),
                               [{**prompt, "drafter": "toy", "draft_max": 4}, {**prompt, "draft_max": 0}],
                               GenerationSettings(n_predict=24))  # toy, then the target alone
    assert [status for status, _ in answers] == [200, 200], answers
    toy_doc, alone = (json.loads(body) for _, body in answers)
    assert toy_doc["choices"][0]["text"] == alone["choices"][0]["text"]
    assert toy_doc["usage"]["speculative"]["n_drafted"] > 0 and toy.n_proposed > 0
