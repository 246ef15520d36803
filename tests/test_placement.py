"""Placement flags: GPU layers from the VRAM planner, explicit --ngl winning with a warning, devices, splits."""

from __future__ import annotations

import json
import logging

import pytest
from typer.testing import CliRunner

from specq.cli.main import app
from specq.errors import PlanError, UsageError
from specq.native.llama import ffi as _ffi
from specq.native.commands import placement as PL
from specq.native.runtime.engine import Engine
from specq.native.core.settings import GenerationSettings

from test_plan import write_qwen2_header

runner = CliRunner()


@pytest.fixture(scope="module")
def big_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("placement")
    target = write_qwen2_header(d / "t.gguf", n_layer=64, n_embd=5120, n_head=40, n_head_kv=8, n_ff=27648,
                                n_vocab=152064, quant="Q4_K_M", tied=False)
    draft = write_qwen2_header(d / "d.gguf", n_layer=24, n_embd=896, n_head=14, n_head_kv=2, n_ff=4864,
                               n_vocab=151936, quant="Q8_0", tied=True)
    return str(target), str(draft)


def test_cpu_build_defaults_to_no_gpu_layers(tiny_target, tiny_close):
    p = PL.resolve_placement(str(tiny_target), str(tiny_close), ctx=256)
    assert (p.ngl, p.ngl_draft) == (0, 0)


def test_budget_plans_layers_and_explicit_ngl_wins_with_a_warning(big_pair, caplog):
    p = PL.resolve_placement(*big_pair, ctx=4096, vram_budget="12GiB")
    assert p.ngl_draft == 25 and 0 < p.ngl < 65  # draft fully first, then part of the target
    with caplog.at_level(logging.WARNING, logger="specq.placement"):
        q = PL.resolve_placement(*big_pair, ctx=4096, vram_budget="12GiB", ngl=65)
    assert q.ngl == 65 and q.ngl_draft == p.ngl_draft
    assert "exceeds the VRAM budget" in caplog.text


def test_budget_too_small_for_the_draft_refuses(big_pair):
    with pytest.raises(PlanError):
        PL.resolve_placement(*big_pair, ctx=4096, vram_budget="1GiB")


def test_two_devices_get_a_tensor_split(big_pair):
    p = PL.resolve_placement(*big_pair, ctx=4096, vram_budget="24GiB,24GiB")
    assert p.tensor_split is not None and len(p.tensor_split) == 2 and all(x >= 0 for x in p.tensor_split)


def test_target_on_gpu_draft_on_cpu_warns_loudly(tiny_target, tiny_close, monkeypatch, caplog):
    monkeypatch.setattr(_ffi, "supports_gpu_offload", lambda: True)
    with caplog.at_level(logging.WARNING, logger="specq.placement"):
        p = PL.resolve_placement(str(tiny_target), str(tiny_close), ctx=256, ngl_draft=0)
    assert p.ngl == PL.ALL_LAYERS and p.ngl_draft == 0
    assert "draft is on the CPU" in caplog.text


@pytest.mark.parametrize("text", ["a,b", "-1,2", "0,0"])
def test_bad_tensor_split(text):
    with pytest.raises(UsageError):
        PL.parse_split(text)


def test_devices_by_name(tiny_target):
    with Engine(tiny_target, tiny_target, ctx=256, threads=1, devices=["CPU"], draft_devices=["CPU"]) as e:
        g = e.session().generate(e.tokenize("def f(x):"), GenerationSettings(n_predict=8)).run()
        assert g.stats.n_generated == 8
    with pytest.raises(UsageError, match="unknown device NOPE"):
        _ffi.device_handles(["NOPE"])


def bench(*args):
    return runner.invoke(app, ["bench", *map(str, args)])


def test_bench_unknown_device_is_a_one_line_usage_error(tiny_target, tiny_close):
    r = bench("--target", tiny_target, "--draft", tiny_close, "--device", "NOPE", "--threads", 1, "--ctx", 256)
    assert r.exit_code == 2
    assert r.stderr.strip().count("\n") == 0 and "unknown device NOPE" in r.stderr


def test_bench_budget_fraction_without_a_gpu_fails_clearly(tiny_target, tiny_close):
    r = bench("--target", tiny_target, "--draft", tiny_close, "--vram-budget", "0.9", "--threads", 1)
    assert r.exit_code == 1 and r.stderr.startswith("specq: error: ")
    assert r.stderr.strip().count("\n") == 0


def test_bench_draft_max_auto_accept_and_chat_flags(tiny_target, tiny_close):
    r = bench("--target", tiny_target, "--draft", tiny_close, "--draft-max", "auto", "--temp", 0.8,
              "--accept", "rejection", "--chat", "--prompt", "Tell me about foxes.", "--n-predict", 16,
              "--threads", 1, "--ctx", 512, "--ctx-draft", 256, "--threads-draft", 1, "--device", "CPU", "--json",
              "-", "-q")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["settings"]["draft_max"] == "auto" and doc["settings"]["accept"] == "rejection"
    assert doc["settings"]["device"] == "CPU" and doc["settings"]["ctx_draft"] == 256
    assert doc["settings"]["draft_window"] == 256  # what the engine made of it
    spec = [row for row in doc["runs"] if row["mode"] == "speculative"][0]
    raw = bench("--target", tiny_target, "--draft", tiny_close, "--prompt", "Tell me about foxes.", "--n-predict", 4,
                "--threads", 1, "--ctx", 512, "--json", "-", "-q")
    # by default no fixed window: the draft reads everything, or a window where a trial at long context
    # measures that it pays (each run's draft_window says which)
    short = json.loads(raw.stdout)
    assert short["settings"]["draft_window"] is None and short["settings"]["ctx_draft"] == "auto"
    assert [r["draft_window"] for r in short["runs"] if r["mode"] == "speculative"] == [None]  # a short prompt
    # --chat wrapped the prompt in the tiny model's ChatML template (<|im_start|>user ... assistant)
    assert spec["n_prompt"] >= json.loads(raw.stdout)["runs"][0]["n_prompt"] + 6
    assert doc["summary"]["identical_output"] is None  # temperature > 0


def test_bench_draft_max_must_be_number_or_auto(tiny_target, tiny_close):
    r = bench("--target", tiny_target, "--draft", tiny_close, "--draft-max", "lots")
    assert r.exit_code == 2 and "--draft-max must be a number or auto" in r.stderr
