"""EngineConfig: one object carries every Engine option from the flags down to Engine(...)."""

from __future__ import annotations

import inspect
import json

import pytest
from typer.testing import CliRunner

import specq.native.commands.bench as bench_lib
from specq.cli._common import Flags, engine_config
from specq.cli.main import app
from specq.native.runtime.config import EngineConfig
from specq.native.runtime.engine import Engine
from specq.native.core.settings import GenerationSettings
from test_bench_sweep import FakeEngine


def test_the_options_and_their_defaults_are_stated_once():
    """Engine takes an EngineConfig (or its fields as keywords): its own signature states no option or default,
    so that a new option is written in one place."""
    params = inspect.signature(Engine.__init__).parameters
    assert list(params) == ["self", "target", "draft", "clock", "options"]
    with pytest.raises(TypeError):
        Engine("t.gguf", no_such_option=1)  # a keyword that is no field fails before any load


def test_flags_become_one_config():
    flags = Flags({"threads": 2, "ctx_draft": "128", "threads_draft": 1, "ngl": 0, "ngl_draft": 0, "main_gpu": 1,
                   "tensor_split": "3,1", "device": "CPU", "draft_device": "CPU", "cpu_amx": True, "flash_attn": "on"})
    cfg = engine_config("t.gguf", "d.gguf", GenerationSettings(drafter="auto"), flags, ctx=512)
    assert cfg == EngineConfig("t.gguf", "d.gguf", ctx=512, threads=2, ngl=0, ngl_draft=0, main_gpu=1,
                               tensor_split=(3.0, 1.0), draft_tensor_split=(3.0, 1.0), devices=("CPU",),
                               draft_devices=("CPU",), draft_ctx=128, draft_threads=1, cpu_amx=True,
                               flash_attn="on", draft_flash_attn="on", mtp=None)  # auto: the MTP head where present


def test_bench_hands_the_config_to_the_engine(monkeypatch):
    seen = []

    class Recording(FakeEngine):
        def __init__(self, config, clock=None):
            super().__init__(config, clock)
            seen.append((config, clock))

    monkeypatch.setattr(bench_lib, "Engine", Recording)
    r = CliRunner().invoke(app, ["bench", "--target", "t.gguf", "--draft", "d.gguf", "--prompt", "a", "--ctx", "512",
                                 "--ctx-draft", "128", "--threads-draft", "1", "--ngl", "0", "--ngl-draft", "0",
                                 "--tensor-split", "3,1", "--drafter", "mtp", "--draft-max", "2", "--json", "-"])
    assert r.exit_code == 0, r.output
    (config, clock), = seen
    assert config.draft is None and clock is None  # --drafter mtp loads no draft model
    assert config == EngineConfig("t.gguf", ctx=512, tensor_split=(3.0, 1.0), draft_tensor_split=(3.0, 1.0),
                                  draft_ctx=128, draft_threads=1, flash_attn="off", draft_flash_attn="off", mtp=True)
    assert json.loads(r.stdout)["settings"]["ctx_draft"] == 128


@pytest.mark.parametrize("flag", ["--ctx-draft", "--flash-attn"])
def test_bad_engine_flag_is_one_line(flag):
    r = CliRunner().invoke(app, ["bench", "--target", "t.gguf", "--prompt", "a", flag, "nope"])
    assert r.exit_code == 2 and r.stderr.strip().count("\n") == 0 and flag in r.stderr
