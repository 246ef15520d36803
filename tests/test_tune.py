"""`specq tune` in-process: calibration output, JSON, and --write into the pair manifest."""

from __future__ import annotations

import json
import shutil
import tomllib

from typer.testing import CliRunner

from specq.cli.main import app
from specq.manifest import MANIFEST_NAME, sha256_file, write_manifest

runner = CliRunner()


def tune(*args):
    return runner.invoke(app, ["tune", *map(str, args)])


def test_tune_prints_acceptance_costs_and_recommendation(tiny_target, tiny_close):
    r = tune("--target", tiny_target, "--draft", tiny_close, "--n-predict", 16, "--draft-max", 4, "--threads", 1,
             "--json", "-")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert len(doc["accept_by_pos"]) == 4 and 0 < doc["accept_rate"] < 1
    assert doc["accept_by_pos"][0] >= doc["accept_rate"] * 0.5
    assert set(doc["verify_ms"]) >= {"1", "2", "5"} and doc["target_ms"] > 0
    assert doc["cost_ratio"] == doc["draft_ms"] / doc["target_ms"]
    assert 0 <= doc["recommended_draft_max"] <= 4
    assert "acceptance at position 1" in r.stderr and "cost ratio" in r.stderr


def test_tune_write_adds_tuned_table_and_keeps_the_rest(tiny_target, tiny_close, tmp_path):
    for src, name in ((tiny_target, "t.gguf"), (tiny_close, "d.gguf")):
        shutil.copy(src, tmp_path / name)
    entry = lambda n: {"file": n, "sha256": sha256_file(tmp_path / n), "architecture": "llama"}  # noqa: E731
    write_manifest(tmp_path, entry("t.gguf"), entry("d.gguf"), {"draft_max": 8, "p_min": 0.0})
    r = tune("--pair", tmp_path, "--n-predict", 12, "--draft-max", 3, "--threads", 1, "--write", "-q")
    assert r.exit_code == 0, r.output
    doc = tomllib.loads((tmp_path / MANIFEST_NAME).read_text())
    assert doc["settings"] == {"draft_max": 8, "p_min": 0.0}
    assert doc["target"]["file"] == "t.gguf"
    t = doc["tuned"]
    assert t["draft_max"] == "auto" or 1 <= t["draft_max"] <= 3
    assert len(t["accept_by_pos"].split(",")) == 3 and t["cost_ratio"] > 0


def test_tune_write_without_pair_is_a_usage_error(tiny_target, tiny_close):
    r = tune("--target", tiny_target, "--draft", tiny_close, "--write")
    assert r.exit_code == 2
    assert r.stderr.strip().startswith("specq: error: --write needs --pair")


def test_tune_needs_a_draft(tiny_target):
    r = tune("--target", tiny_target)
    assert r.exit_code == 2 and "needs a draft" in r.stderr
