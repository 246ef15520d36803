"""Pair presets: every packaged file against the schema, `specq presets`, and `specq convert --preset`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tomllib
from importlib import resources
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli_bin import SPECQ
from hfmodels import HFSpec, variant, write_checkpoint
from specq.cli import convert as cli_convert
from specq.cli.main import app
from specq.convert import presets
from specq.convert.arch import SUPPORTED
from specq.manifest import load_pair
from specq.convert.quantize import QUANT_TYPES
from specq.errors import ManifestError, UsageError
from specq.native.llama import ffi as _ffi

runner = CliRunner()
PRESET_FILES = sorted(p for p in resources.files("specq.models").iterdir() if p.name.endswith(".toml"))
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9._-]+$")


def raw(name: str) -> dict:
    return tomllib.loads((resources.files("specq.models") / f"{name}.toml").read_text(encoding="utf-8"))


def test_the_initial_set_is_packaged():
    names = {p.name for p in presets.load_presets().values()}
    assert names == {"qwen2.5-7b", "qwen2.5-32b", "qwen2.5-coder-32b", "qwen3-8b", "qwen3-32b", "llama3.1-8b",
                     "smollm2-1.7b", "gemma3-27b-1b", "gemma3-27b-270m", "qwen3.6-27b"}
    assert len(PRESET_FILES) == len(names)


@pytest.mark.parametrize("path", PRESET_FILES, ids=lambda p: p.name)
def test_each_file_parses_against_the_schema(path):
    doc = tomllib.loads(path.read_text(encoding="utf-8"))
    p = presets.parse_preset(doc, path.name)
    assert set(presets.TOP_KEYS) <= set(doc) <= set(presets.TOP_KEYS) | set(presets.OPTIONAL_KEYS)
    assert set(doc["settings"]) == set(presets.SETTINGS_KEYS)
    assert REPO_ID.match(p.target) and REPO_ID.match(p.draft) and p.target != p.draft
    # Quant types must be ones this llama.cpp build knows, not only names specq lists.
    known = _ffi.ftype_by_name()
    assert p.target_quant in QUANT_TYPES and p.draft_quant in QUANT_TYPES
    assert p.target_quant in known and p.draft_quant in known
    assert p.architecture in SUPPORTED
    assert "\n" not in p.note and p.note
    assert 0 < p.gguf_gib < p.download_gib and p.gguf_gib < p.vram_gib
    assert "ESTIMATES" in path.read_text(encoding="utf-8")  # the sizes say they are estimates
    assert p.vocab_verified and "\n" not in p.vocab_verified
    if p.context_length_two_cards is not None:  # two 24 GiB cards: more context than one, and it fits in 48
        assert p.context_length_two_cards > p.context_length and p.vram_gib < p.vram_gib_two_cards <= 48
    if p.target.endswith("-27b-it") or p.target.endswith("-27B"):  # the headline size states both layouts
        assert p.vram_gib <= 24 and p.context_length_two_cards is not None


def test_qwen36_preset():
    p = presets.get_preset("qwen3.6-27b")
    assert p.architecture == "Qwen3_5ForConditionalGeneration" and p.target_quant == "Q4_K_M"
    assert p.vram_gib <= 24 < p.vram_gib_two_cards <= 48 and p.context_length_two_cards > p.context_length
    assert p.vocab_verified == "no"  # not compared here: the comment in the file says why


def test_names_unique_and_match_files():
    names = [tomllib.loads(p.read_text(encoding="utf-8"))["name"] for p in PRESET_FILES]
    assert len(set(names)) == len(names)
    assert [n + ".toml" for n in names] == [p.name for p in PRESET_FILES]


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(colour="red"), "unknown key in preset (x.toml: colour)"),
    (lambda d: d.pop("draft"), "missing key in preset (x.toml: draft)"),
    (lambda d: d.update(context_length="8k"), "wrong type in preset (x.toml: context_length = '8k')"),
    (lambda d: d.update(context_length=True), "wrong type in preset (x.toml: context_length = True)"),
    (lambda d: d["settings"].update(p_min="high"), "wrong type in preset (x.toml [settings]: p_min"),
    (lambda d: d["settings"].update(k=3), "unknown key in preset (x.toml [settings]: k)"),
    (lambda d: d.update(target="Qwen2.5-7B-Instruct"), "target is not a Hub repo id like org/name"),
    (lambda d: d.update(draft="https://huggingface.co/Qwen/x"), "draft is not a Hub repo id"),
    (lambda d: d.update(target_quant="Q4_K_XL"), "unknown target_quant (x.toml: 'Q4_K_XL')"),
    (lambda d: d.update(architecture="GPTNeoXForCausalLM"), "architecture the converter does not support"),
    (lambda d: d["settings"].update(p_min=1.5), "preset value out of range"),
    (lambda d: d["settings"].update(draft_max="sometimes"), "draft_max must be an integer or \"auto\""),
    (lambda d: d["settings"].update(draft_max=0), "preset value out of range"),
    (lambda d: d["settings"].update(draft_max=2, draft_min=3), "preset value out of range"),
    (lambda d: d.update(note="two\nlines"), "note must be one line"),
    (lambda d: d.pop("vocab_verified"), "missing key in preset (x.toml: vocab_verified)"),
    (lambda d: d.update(vocab_verified=""), "vocab_verified must be one line, not empty"),
    (lambda d: d.update(context_length_two_cards=16384), "gives context_length_two_cards without vram_gib_two_cards"),
    (lambda d: d.update(context_length_two_cards=1024, vram_gib_two_cards=9.0), "two-card values out of range"),
])
def test_schema_errors_are_clear(change, message):
    doc = raw("qwen2.5-7b")
    change(doc)
    with pytest.raises(ManifestError) as e:
        presets.parse_preset(doc, "x.toml")
    assert message in str(e.value)


def test_draft_max_is_a_number_or_auto():
    assert presets.parse_preset(raw("qwen2.5-7b"), "x.toml").settings["draft_max"] == "auto"
    doc = raw("qwen2.5-7b")
    doc["settings"].update(draft_max=6, draft_min=2)
    assert presets.parse_preset(doc, "x.toml").settings["draft_max"] == 6


def test_unknown_preset_lists_the_names():
    with pytest.raises(UsageError) as e:
        presets.get_preset("qwen9")
    assert "unknown preset (qwen9)" in str(e.value) and "qwen2.5-7b" in str(e.value)


def test_presets_json_shape():
    r = runner.invoke(app, ["presets", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert isinstance(doc, list) and len(doc) == len(PRESET_FILES)
    for entry in doc:
        assert set(entry) == set(presets.TOP_KEYS) | set(presets.OPTIONAL_KEYS)
        assert set(entry["settings"]) == set(presets.SETTINGS_KEYS)
        assert isinstance(entry["vram_gib"], float) and isinstance(entry["context_length"], int)
    assert [e["name"] for e in doc] == sorted(e["name"] for e in doc)
    first = next(e for e in doc if e["name"] == "qwen2.5-coder-32b")
    assert first["target"] == "Qwen/Qwen2.5-Coder-32B-Instruct" and first["settings"]["draft_max"] == 16


def test_presets_table_lists_every_pair():
    r = runner.invoke(app, ["presets"], env={"COLUMNS": "200"})
    assert r.exit_code == 0
    for p in presets.load_presets().values():
        assert p.name in r.stdout and p.target in r.stdout and p.draft in r.stdout


def test_convert_unknown_preset_is_one_line_exit_2(tmp_path):
    r = runner.invoke(app, ["convert", "--preset", "nope", "--out", str(tmp_path / "o")])
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1
    assert lines[0].startswith("specq: error: unknown preset (nope); choose one of ") and "smollm2-1.7b" in lines[0]


def test_convert_preset_with_target_is_usage_error(tmp_path):
    r = runner.invoke(app, ["convert", "Qwen/Qwen3-8B", "--preset", "qwen3-8b", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1 and "--preset" in r.stderr


def test_convert_preset_offline_uncached_fails_in_one_line(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "empty-hf-home"))
    env.pop("HF_TOKEN", None)
    out = tmp_path / "out"
    r = subprocess.run([SPECQ, "convert", "--preset", "qwen2.5-7b", "--out", str(out)], env=env,
                       capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith("specq: error: ") and "HF_HUB_OFFLINE" in lines[0]
    assert "Qwen/Qwen2.5-7B-Instruct" in lines[0] and "Traceback" not in r.stderr
    assert not out.exists() or not any(out.iterdir())


def test_convert_preset_uses_its_quants_and_writes_its_settings(tmp_path, monkeypatch):
    # A preset whose "repo ids" are local checkpoints: the same code path as the Hub, no network.
    spec = HFSpec(arch="Qwen2ForCausalLM", n_layer=1)
    t = write_checkpoint(tmp_path / "tgt", spec)
    d = write_checkpoint(tmp_path / "drf", variant(spec, seed=7))
    fake = presets.Preset(name="tiny", architecture="Qwen2ForCausalLM", target=str(t), draft=str(d),
                          target_quant="Q8_0", draft_quant="Q4_0", context_length=2048, note="test",
                          download_gib=1.0, gguf_gib=0.5, vram_gib=0.75, vocab_verified="no",
                          settings={"draft_max": 11, "draft_min": 2, "p_min": 0.3})
    monkeypatch.setattr(cli_convert, "get_preset", lambda name: fake)
    r = runner.invoke(app, ["convert", "--preset", "tiny", "--out", str(tmp_path / "pair"), "-q"])
    assert r.exit_code == 0, r.output
    pair = load_pair(tmp_path / "pair")
    assert pair.target_path.name == "tgt-Q8_0.gguf" and pair.draft_path.name == "drf-Q4_0.gguf"
    s = pair.settings
    assert (s["draft_max"], s["draft_min"], s["p_min"], s["ctx"], s["preset"]) == (11, 2, 0.3, 2048, "tiny")
    assert "cost_ratio" in s  # convert's own measurement stays beside the preset's suggestion
    assert pair.manifest["target"]["quant"] == "Q8_0" and pair.manifest["draft"]["quant"] == "Q4_0"


def test_explicit_quant_wins_over_the_preset(tmp_path, monkeypatch):
    t = write_checkpoint(tmp_path / "tgt", HFSpec(arch="LlamaForCausalLM", n_layer=1))
    fake = presets.Preset(name="tiny", architecture="LlamaForCausalLM", target=str(t), draft=str(t),
                          target_quant="Q8_0", draft_quant="Q8_0", context_length=2048, note="test",
                          download_gib=1.0, gguf_gib=0.5, vram_gib=0.75, vocab_verified="no",
                          settings={"draft_max": 3, "draft_min": 0, "p_min": 0.0})
    monkeypatch.setattr(cli_convert, "get_preset", lambda name: fake)
    r = runner.invoke(app, ["convert", "--preset", "tiny", "--quant", "none", "--draft-quant", "Q4_0",
                            "--out", str(tmp_path / "pair"), "-q"])
    assert r.exit_code == 0, r.output
    pair = load_pair(tmp_path / "pair")
    assert pair.manifest["target"]["quant"] in ("BF16", "F16", "F32") and pair.manifest["draft"]["quant"] == "Q4_0"


def test_wheel_metadata_ships_the_presets():
    # pyproject's package-data must carry the TOML files; a non-editable install reads them the same way.
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text(encoding="utf-8"))
    assert "*.toml" in pyproject["tool"]["setuptools"]["package-data"]["specq.models"]
