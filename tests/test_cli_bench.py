"""`specq bench` in-process: JSON contract and one-line errors with the right exit codes."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specq.cli.main import app

runner = CliRunner()


def bench(*args):
    return runner.invoke(app, ["bench", *map(str, args)])


def assert_one_line_error(result, code, *fragments):
    assert result.exit_code == code, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("specq: error: ") or code == 2
    assert "Traceback" not in result.output + result.stderr
    for f in fragments:
        assert f in lines[0]


def test_json_to_stdout_has_the_contract_keys(tiny_target, tiny_close):
    # a fixed draft length: on models this tiny, the default (auto) rightly finds that drafting does not pay
    r = bench("--target", tiny_target, "--draft", tiny_close, "--prompt", "def fibonacci(n):", "--prompt",
              "The quick brown fox", "--n-predict", 24, "--repeat", 2, "--ctx", 256, "--draft-max", 4, "--json", "-")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)  # stdout holds only the JSON document
    assert set(doc) >= {"specq_version", "llama_cpp_python_version", "target", "draft", "settings", "runs", "summary"}
    assert set(doc["target"]) == {"path", "size_bytes", "n_params"}
    for k in ("n_predict", "draft_max", "draft_min", "p_min", "temp", "top_k", "top_p", "min_p", "seed", "ctx",
              "threads", "ngl", "ngl_draft", "repeat"):
        assert k in doc["settings"], k
    assert len(doc["runs"]) == 2 * 2 * 2
    assert [r["mode"] for r in doc["runs"][:2]] == ["baseline", "speculative"]  # alternating
    row_keys = {"mode", "prompt_index", "repeat", "text", "tokens", "n_prompt", "n_generated", "tokens_per_s",
                "prompt_ms", "gen_ms", "n_steps", "n_drafted", "n_accepted", "accept_rate", "accepted_per_pos",
                "draft_ms", "verify_ms"}
    for row in doc["runs"]:
        assert set(row) >= row_keys
        if row["mode"] == "baseline":
            assert row["n_drafted"] is None and row["accept_rate"] is None and row["verify_ms"] is None
        else:
            assert row["n_drafted"] > 0
            assert row["accept_rate"] == pytest.approx(row["n_accepted"] / row["n_drafted"])
        assert row["tokens_per_s"] == pytest.approx(row["n_generated"] / (row["gen_ms"] / 1000))
    s = doc["summary"]
    assert s["identical_output"] is True
    assert s["speedup"] == pytest.approx(s["speculative_tokens_per_s"] / s["baseline_tokens_per_s"])
    assert "speed-up" in r.stderr  # the human table went to stderr


def test_no_baseline_nulls_the_baseline_summary(tiny_target, tiny_close, tmp_path):
    out = tmp_path / "b.json"
    r = bench("--target", tiny_target, "--draft", tiny_close, "--n-predict", 8, "--ctx", 256, "--no-baseline",
              "--json", out, "-q")
    assert r.exit_code == 0, r.output
    s = json.loads(out.read_text())["summary"]
    assert s["baseline_tokens_per_s"] is None and s["speedup"] is None and s["identical_output"] is None


def test_prompt_file_jsonl(tiny_target, tiny_close, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "def f(x):"}\n\n{"prompt": "The dog"}\n')
    r = bench("--target", tiny_target, "--draft", tiny_close, "--prompt-file", f, "--n-predict", 8, "--ctx", 256,
              "--json", "-", "-q")
    assert r.exit_code == 0, r.output
    assert {row["prompt_index"] for row in json.loads(r.stdout)["runs"]} == {0, 1}


@pytest.mark.parametrize("flag,value,fragment", [
    ("--draft-max", 0, "--draft-max"),
    ("--n-predict", 0, "--n-predict"),
    ("--temp", -1, "--temp"),
    ("--top-p", 0, "--top-p"),
    ("--top-p", 1.5, "--top-p"),
    ("--repeat", 0, "--repeat"),
])
def test_bad_values_exit_2_with_one_line(tiny_target, tiny_close, flag, value, fragment):
    r = bench("--target", tiny_target, "--draft", tiny_close, flag, value)
    assert_one_line_error(r, 2, fragment)


def test_missing_file(tmp_path, tiny_close):
    r = bench("--target", tmp_path / "nope.gguf", "--draft", tiny_close)
    assert_one_line_error(r, 1, "not found", "nope.gguf")


def test_non_gguf_file(tmp_path, tiny_close):
    f = tmp_path / "model.gguf"
    f.write_text("this is not a model")
    r = bench("--target", f, "--draft", tiny_close)
    assert_one_line_error(r, 1, "not a GGUF file")


def test_truncated_gguf(tmp_path, tiny_target, tiny_close):
    data = tiny_target.read_bytes()
    f = tmp_path / "truncated.gguf"
    f.write_bytes(data[: len(data) // 2])
    r = bench("--target", f, "--draft", tiny_close)
    assert_one_line_error(r, 1, "model file is truncated", "truncated.gguf")


def test_a_draft_of_another_vocabulary_runs_translated_with_no_flag(tiny_target, tiny_incompatible):
    # token 40's text differs: llama.cpp's rule refuses the pair; specq translates (TLI under auto) and says so
    r = bench("--target", tiny_target, "--draft", tiny_incompatible, "--prompt", "def fibonacci(n):",
              "--n-predict", 16, "--ctx", 128, "--draft-max", 4, "--json", "-")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["draft"]["vocabulary"] == "different" and doc["draft"]["vocab_map"] == "tli"
    assert 0.9 < doc["draft"]["vocab_overlap"] < 1.0
    base, spec = doc["runs"]
    assert spec["tokens"] == base["tokens"] and spec["n_drafted"] > 0
    # under auto, the steps each translation drafted (the trial's first block is TLI's)
    ran = doc["draft"]["vocab_map_steps"]
    assert ran["tli"] == spec["n_vocab_tli_steps"] > 0 and ran["string"] == spec["n_vocab_string_steps"]
    table = bench("--target", tiny_target, "--draft", tiny_incompatible, "--prompt", "def fibonacci(n):",
                  "--n-predict", 8, "--ctx", 128, "--draft-max", 4, "--vocab-map", "string")
    assert table.exit_code == 0, table.output
    assert "translated by string" in table.stdout and "of its mass on shared tokens" in table.stdout
    bad = bench("--target", tiny_target, "--draft", tiny_incompatible, "--vocab-map", "bytes")
    assert_one_line_error(bad, 2 if bad.exit_code == 2 else 1, "--vocab-map must be")


def test_prompt_longer_than_context(tiny_target, tiny_close):
    r = bench("--target", tiny_target, "--draft", tiny_close, "--ctx", 32, "--prompt", "word " * 400)
    assert_one_line_error(r, 1, "does not fit in the context")


def test_llama_log_is_silent_by_default(tiny_target, tiny_close):
    r = bench("--target", tiny_target, "--draft", tiny_close, "--n-predict", 4, "--ctx", 256, "-q")
    assert r.exit_code == 0
    assert "llama_model_loader" not in r.output + r.stderr
    assert "llama_context" not in r.output + r.stderr


def test_verbose_shows_llama_log(tiny_target, tiny_close):
    r = bench("--target", tiny_target, "--draft", tiny_close, "--n-predict", 4, "--ctx", 256, "-v")
    assert r.exit_code == 0
    assert "llama_model_loader" in r.stderr


def test_version():
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.stdout.startswith("specq ")
