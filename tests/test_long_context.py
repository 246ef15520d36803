"""Long context: the attention path each model gets (--flash-attn) and that llama.cpp receives it."""

from __future__ import annotations

import json
import logging

import pytest

from loglines import LogLines
from specq.errors import UsageError
from specq.native.llama import ffi as _ffi
from specq.native.runtime.config import choose_flash_attn


def test_auto_turns_flash_attention_off_on_the_cpu_and_leaves_gpus_to_llama_cpp():
    assert choose_flash_attn("auto", 0, None) == "off"
    assert choose_flash_attn("auto", 999, ("CPU",)) == "off"
    assert choose_flash_attn("auto", 999, ("CUDA0",)) == "auto"
    assert choose_flash_attn("auto", 999, ("CUDA0", "CPU")) == "auto"
    assert choose_flash_attn("on", 0, None) == "on" and choose_flash_attn("off", 999, ("CUDA0",)) == "off"
    # two sequences or more in one unified cache: the flash kernel skips the other sequences' masked cells
    assert choose_flash_attn("auto", 0, None, parallel=1) == "off"
    assert choose_flash_attn("auto", 0, None, parallel=2) == "on"
    assert choose_flash_attn("auto", 0, None, parallel=4, streams=True) == "off"  # each row its own stream
    assert choose_flash_attn("on", 0, None, parallel=4, streams=True) == "on"
    assert choose_flash_attn("auto", 999, (), parallel=8) == "on"
    assert choose_flash_attn("auto", 999, ("CUDA0",), parallel=8) == "auto"
    assert choose_flash_attn("off", 0, None, parallel=8) == "off"
    with pytest.raises(UsageError, match="--flash-attn must be auto, on or off"):
        choose_flash_attn("yes", 0, None)


def _context_log(path, flash_attn: str) -> list[str]:
    lg = logging.getLogger("specq.llama")
    h, old = LogLines(), lg.level
    lg.addHandler(h)
    lg.setLevel(logging.DEBUG)
    try:
        with _ffi.Model(path) as m, _ffi.Context(m, 128, 1, name="t", flash_attn=flash_attn) as c:
            c.decode(m.tokenize("The quick brown fox"), 0)
    finally:
        lg.removeHandler(h)
        lg.setLevel(old)
    return [line for line in h.lines if "flash_attn" in line]


@pytest.mark.parametrize("flag, shown", [("off", "disabled"), ("on", "enabled"), ("auto", "auto")])
def test_the_attention_path_reaches_llama_cpp(tiny_target, flag, shown):
    lines = _context_log(tiny_target, flag)
    assert any(line.split("=")[-1].strip() == shown for line in lines), lines


@pytest.fixture
def contexts_seen(monkeypatch) -> list[tuple[str, str]]:
    """(name, flash_attn) of every llama.cpp context the engine creates while the test runs."""
    from specq.native.runtime import engine

    seen = []
    real = engine._ffi.Context

    def spy(*args, **kwargs):
        seen.append((kwargs.get("name"), kwargs.get("flash_attn")))
        return real(*args, **kwargs)

    monkeypatch.setattr(engine._ffi, "Context", spy)
    return seen


def test_bench_records_the_attention_path_of_each_model(tiny_target, tiny_close, contexts_seen):
    from typer.testing import CliRunner

    from specq.cli.main import app

    seen = contexts_seen
    base = ["bench", "--target", str(tiny_target), "--draft", str(tiny_close), "--n-predict", "4", "--threads", "1",
            "--json", "-", "-q", "--ngl", "0", "--ngl-draft", "0"]
    for extra, want in (([], "off"), (["--flash-attn", "on"], "on")):
        seen.clear()
        r = CliRunner().invoke(app, base + extra)
        assert r.exit_code == 0, r.output
        settings = json.loads(r.stdout)["settings"]
        assert settings["flash_attn"] == settings["draft_flash_attn"] == want
        assert set(seen) == {("target", want), ("draft", want)}


def test_the_engine_applies_the_same_rule_when_called_directly(tiny_target, tiny_close, contexts_seen):
    from specq.native.runtime import engine

    seen = contexts_seen
    with engine.Engine(tiny_target, tiny_close, ctx=128, threads=1):
        pass
    with engine.Engine(tiny_target, tiny_close, ctx=128, threads=1, flash_attn="on", draft_flash_attn="auto"):
        pass
    assert seen == [("target", "off"), ("draft", "off"), ("target", "on"), ("draft", "off")]
