"""`specq bench`, complete: sweeps, prompt set, repeats, CSV, plot, cost model, rendering with a fake engine."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field

import pytest
from rich.console import Console
from typer.testing import CliRunner

import specq.native.commands.bench as bench_lib
from specq.cli.bench import cost_line, histogram, parse_list, recommendation_line, report
from specq.cli.main import app
from specq.errors import UsageError
from specq.native.commands.bench import CSV_COLUMNS, load_prompt_set
from specq.native.runtime.config import EngineConfig
from specq.native.core.stats import GenerationStats
from specq.native.runtime.engine import ModelInfo

runner = CliRunner()


# ---- a fake engine: canned stats whose speed depends on draft-max --------------------------------------
@dataclass
class FakeGen:
    settings: object
    speculative: bool
    stats: GenerationStats | None = None
    tokens: list[int] = field(default_factory=lambda: list(range(10)))
    text: str = "0123456789"

    def run(self):
        k = self.settings.draft_max
        if self.speculative:
            # each step costs 1 ms per drafted token plus 10 ms of verify; every step reaches positions 1 and 2
            # (where it drafts 2); all accept the 1st, half the 2nd, and none reaches a later position
            steps = 4
            drafted = steps * k
            accepted = sum((steps, steps // 2)[:k])
            self.stats = GenerationStats(True, 5, 10, steps, drafted, accepted, (steps, steps // 2)[:k], 1.0,
                                         1.0 * drafted, 10.0 * steps, 1.0 * drafted + 10.0 * steps + 2.0, 1.0, 0,
                                         "n_predict", steps_by_k=((k, steps),), tried_per_pos=(steps, steps)[:k],
                                         verify_ms_by_size=((k + 1, steps, 10.0 * steps),),
                                         draft_next_ms=1.0 * steps * (k - 1), n_draft_next=steps * (k - 1))
        else:
            self.stats = GenerationStats(False, 5, 10, 10, 0, 0, (), 1.0, 0.0, 0.0, 100.0, 90.0, 0, "n_predict")
        return self


class FakeSession:
    def reset(self):
        pass

    def generate(self, toks, settings, speculative=True):
        return FakeGen(settings, speculative)


class FakeEngine:
    threads = 2
    draft_window = None
    window_auto = False
    vocabulary, vocab_translation, vocab_overlap, vocab_chooser = "same", None, None, None

    def __init__(self, config, clock=None):
        self.draft = config.draft

    def tokenize(self, text):
        return [1, 2, 3]

    def session(self):
        return FakeSession()

    def info(self, which):
        return ModelInfo(f"/m/{which}.gguf", 1000, 10, 2, 100)

    def __enter__(self):
        return self

    def __exit__(self, *a):
        pass


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(bench_lib, "Engine", FakeEngine)


def test_sweep_document_with_fake_engine(fake, tmp_path):
    r = runner.invoke(app, ["bench", "--target", "t.gguf", "--draft", "d.gguf", "--sweep-draft-max", "1,2,4,8",
                            "--sweep-p-min", "0,0.5", "--prompt", "a", "--prompt", "b", "--repeat", "3",
                            "--json", "-", "--csv", str(tmp_path / "b.csv")])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert [(p["draft_max"], p["p_min"]) for p in doc["sweep"]] == [(k, p) for k in (1, 2, 4, 8) for p in (0, 0.5)]
    # runs: per repeat and prompt, one baseline and one speculative run per point, baseline first
    assert len(doc["runs"]) == 3 * 2 * (1 + 8)
    assert [r["mode"] for r in doc["runs"][:2]] == ["baseline", "speculative"]
    for pt in doc["sweep"]:
        s = pt["summary"]
        assert s["baseline_tokens_per_s"] == pytest.approx(100.0)  # 10 tokens in 100 ms
        k = pt["draft_max"]
        assert s["speculative_tokens_per_s"] == pytest.approx(10 / ((k * 4 + 40 + 2) / 1000))
        # α: accepted ÷ positions reached (1 and 2); accept_rate: accepted ÷ every drafted token
        assert s["alpha"] == pytest.approx(1.0 if k == 1 else 6 / 8)
        assert s["accept_rate"] == pytest.approx((4 if k == 1 else 6) / (4 * k))
        assert s["cost_ratio"] == pytest.approx(1.0 / 10.0)  # 1 ms per drafted token ÷ 10 ms per baseline token
        assert s["verify_cost"] == pytest.approx(1.0)  # 10 ms per verify ÷ 10 ms per baseline token
        # the model: E = 1 + α1 + α1·α2 tokens per step (α = 1, 0.5), 1 ms per drafted token, 10 ms per verify,
        # 0.5 ms overhead per step; the ideal prices a verify and its overhead as one baseline token (10 ms)
        expected = 1 + 1 + (0.5 if k >= 2 else 0)
        predicted = 4 * expected / ((4 * k + 40 + 2) / 1000)
        assert s["alpha_per_pos"] == ([1.0, 0.5] if k >= 2 else [1.0])
        assert s["predicted_tokens_per_s"] == pytest.approx(predicted)
        assert s["predicted_speedup"] == pytest.approx(predicted / 100.0)
        assert s["ideal_speedup"] == pytest.approx(4 * expected / ((4 * k + 40) / 1000) / 100.0)
        assert s["draft_first_ms"] == pytest.approx(1.0) and s["verify_ms_by_size"] == {str(k + 1): pytest.approx(10.0)}  # JSON keys
        assert s["accepted_per_pos"] == [4 * 6, 2 * 6][:k] and s["accept_at_pos"] == [1.0, 0.5][:k]
    best = doc["recommendation"]
    assert (best["draft_max"], best["p_min"]) == (1, 0)  # the fake gets slower with every drafted token
    assert doc["summary"]["draft_max"] == 1  # the top-level summary is the recommended point's
    # the human output went to stderr and names the recommendation
    assert "recommended for this pair and prompts: --draft-max 1 --p-min 0" in r.stderr
    rows = list(csv.DictReader(io.StringIO((tmp_path / "b.csv").read_text())))
    assert len(rows) == len(doc["runs"]) and tuple(rows[0]) == CSV_COLUMNS
    assert rows[0]["mode"] == "baseline" and rows[0]["draft_max"] == "" and rows[1]["draft_max"] == "1"


def test_report_fits_80_columns(fake):
    cfg = bench_lib.BenchConfig(engine=EngineConfig("t", "d"), prompts=("a",), sweep=((1, 0.0), (4, 0.5)),
                                prompt_names=("code",), repeat=2)
    doc = bench_lib.run_bench(cfg)
    c = Console(width=80, record=True, color_system=None)
    c.print(report(doc))
    text = c.export_text()
    assert max(len(ln) for ln in text.splitlines()) <= 80
    for frag in ("code", "base", "spec", "ideal", "speed-up", "accepted ≥ i draft tokens", "recommended"):
        assert frag in text, frag
    assert "…" not in text  # nothing truncated


def test_cost_line_histogram_and_recommendation_are_pure():
    s = {"alpha": 0.8, "cost_ratio": 0.1, "verify_cost": 1.2, "ideal_speedup": 2.5, "predicted_speedup": 2.2,
         "speedup": 1.9, "accept_at_pos": [0.9, 0.45]}
    line = cost_line(s)
    assert "α 0.80" in line and "c 0.100" in line and "ideal 2.50×" in line and "measured 1.90×" in line
    h = histogram(s, width=10).plain
    assert "█" * 9 + " " in h and "45.0%" in h
    assert cost_line({"alpha": None}) is None and histogram({}) is None
    assert recommendation_line({"recommendation": None}) is None


def test_sweep_draft_max_takes_auto_and_rejects_other_words():
    r = runner.invoke(app, ["bench", "--sweep-draft-max", "2,sometimes"])
    assert r.exit_code == 2 and "--sweep-draft-max takes a comma-separated list of numbers or auto" in r.stderr


def test_parse_list():
    assert parse_list("--sweep-draft-max", "1,2, 4,2", int) == [1, 2, 4]
    assert parse_list("--x", None, int) == []
    with pytest.raises(UsageError, match="--sweep-p-min"):
        parse_list("--sweep-p-min", "0,high", float)


def test_prompt_set_default_has_the_five_kinds():
    names, prompts = load_prompt_set("default")
    assert names == ("code", "chat", "reasoning", "chinese", "summary")
    assert any("\u4e00" <= ch <= "\u9fff" for ch in prompts[3])
    assert len(prompts[4]) > 2000  # a long document to summarize
    with pytest.raises(UsageError, match="unknown prompt set .*default"):
        load_prompt_set("nope")


@pytest.mark.parametrize("args,fragment", [
    (["--sweep-draft-max", "1,x"], "--sweep-draft-max"),
    (["--sweep-draft-max", "0,2"], "--draft-max"),
    (["--sweep-p-min", "1.5"], "--p-min"),
    (["--prompt-set", "default", "--prompt", "x"], "not several"),
    (["--prompt-set", "nope"], "unknown prompt set"),
])
def test_bad_sweep_flags_exit_2(args, fragment):
    r = runner.invoke(app, ["bench", "--target", "t.gguf", "--draft", "d.gguf", *args])
    assert r.exit_code == 2, r.output
    assert len(r.stderr.strip().splitlines()) == 1 and fragment in r.stderr


def test_plot_without_matplotlib_is_one_line(monkeypatch, fake, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    r = runner.invoke(app, ["bench", "--target", "t.gguf", "--draft", "d.gguf", "--plot", str(tmp_path / "p.png")])
    assert r.exit_code == 1
    assert r.stderr.strip().splitlines() == [
        "specq: error: --plot needs matplotlib (not installed); run `pip install 'specq[plot]'` or drop --plot"]
    assert not (tmp_path / "p.png").exists()


# ---- on the tiny models ----------------------------------------------------------------------------------
def test_sweep_on_tiny_models_with_prompt_set_csv_and_plot(tiny_target, tiny_close, tmp_path):
    png, out, table = tmp_path / "s.png", tmp_path / "s.json", tmp_path / "s.csv"
    r = runner.invoke(app, ["bench", "--target", str(tiny_target), "--draft", str(tiny_close), "--threads", "1",
                            "--ctx", "4096", "--prompt-set", "default", "--n-predict", "16",
                            "--sweep-draft-max", "1,4,auto", "--sweep-p-min", "0,0.5", "--json", str(out),
                            "--csv", str(table), "--plot", str(png)])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert [p["name"] for p in doc["prompts"]] == ["code", "chat", "reasoning", "chinese", "summary"]
    assert [pt["draft_max"] for pt in doc["sweep"]] == [1, 1, 4, 4, "auto", "auto"]
    assert doc["recommendation"]["draft_max"] in (1, 4, "auto")
    for pt in doc["sweep"]:
        assert pt["summary"]["identical_output"] is True  # every point is exact
    assert doc["divergences"] == []
    assert set(doc["summary"]) >= {"baseline_tokens_per_s", "speculative_tokens_per_s", "speedup", "accept_rate",
                                   "mean_accepted_per_step", "identical_output", "ideal_speedup", "cost_ratio",
                                   "verify_cost", "accepted_per_pos", "speculative_tokens_per_s_min",
                                   "speculative_tokens_per_s_max"}
    assert len(list(csv.reader(table.open()))) == 1 + len(doc["runs"]) == 1 + 5 * 7
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "recommended for this pair and prompts" in r.stdout


def test_pair_folder_gives_models_and_suggested_settings(tiny_target, tiny_close, tmp_path):
    import shutil

    from specq.manifest import sha256_file, write_manifest

    shutil.copy(tiny_target, tmp_path / "t.gguf")
    shutil.copy(tiny_close, tmp_path / "d.gguf")
    write_manifest(tmp_path, {"file": "t.gguf", "sha256": sha256_file(tmp_path / "t.gguf")},
                   {"file": "d.gguf", "sha256": sha256_file(tmp_path / "d.gguf")}, {"draft_max": 3, "p_min": 0.0})
    base = ["bench", "--pair", str(tmp_path), "--threads", "1", "--ctx", "256", "--n-predict", "8", "--json", "-", "-q"]
    r = runner.invoke(app, base)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["settings"]["draft_max"] == 3 and doc["draft"]["path"].endswith("d.gguf")
    r = runner.invoke(app, base + ["--draft-max", "5"])  # the command line wins over the manifest
    assert json.loads(r.stdout)["settings"]["draft_max"] == 5
    r = runner.invoke(app, ["chat", "--pair", str(tmp_path), "--threads", "1", "--ctx", "256", "--n-predict", "4"],
                      input="hello\n")
    assert r.exit_code == 0 and json.loads(r.stderr.strip().splitlines()[-1])["turns"] == 1
    r = runner.invoke(app, base + ["--target", str(tiny_target)])
    assert r.exit_code == 2 and "not both" in r.stderr


def test_pair_with_a_changed_file_is_refused(tiny_target, tiny_close, tmp_path, monkeypatch):
    import shutil

    from specq.manifest import sha256_file, write_manifest

    monkeypatch.setenv("SPECQ_CACHE_DIR", str(tmp_path / "cache"))
    shutil.copy(tiny_target, tmp_path / "t.gguf")
    shutil.copy(tiny_close, tmp_path / "d.gguf")
    write_manifest(tmp_path, {"file": "t.gguf", "sha256": sha256_file(tmp_path / "t.gguf")},
                   {"file": "d.gguf", "sha256": sha256_file(tmp_path / "d.gguf")}, {"draft_max": 3})
    base = ["bench", "--pair", str(tmp_path), "--threads", "1", "--ctx", "256", "--n-predict", "4", "-q"]
    assert runner.invoke(app, base).exit_code == 0  # verified once, remembered in the cache
    data = bytearray((tmp_path / "d.gguf").read_bytes())
    data[-1] ^= 0xFF
    (tmp_path / "d.gguf").write_bytes(bytes(data))
    r = runner.invoke(app, base)
    assert r.exit_code == 1
    assert "does not match its checksum" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_divergence_is_located_and_judged_by_the_target_logit_margin(tiny_target):
    """A speculative run whose tokens differ from the baseline's: the report names the first differing token and
    the target's logits of both tokens there; close logits read as a near tie, distant ones as a bug."""
    import numpy as np

    from specq.cli.bench import divergence_lines
    from specq.native.runtime.engine import Engine
    from specq.native.core.settings import GenerationSettings

    with Engine(tiny_target, None, ctx=256, threads=1) as eng:
        toks = eng.tokenize("The quick brown fox")
        base = eng.session().generate(toks, GenerationSettings(n_predict=12), speculative=False).run().tokens
        assert len(set(base)) > 3  # not degenerate
        eng.tgt_ctx.clear()
        eng.tgt_ctx.decode(toks + base[:5], 0, logits="last")
        row = eng.tgt_ctx.logits(1)[0].copy()
        order = [int(t) for t in np.argsort(row)[::-1] if int(t) != base[5]]
        close, far = order[0], order[-1]  # the runner-up, and the least likely token
        runs = [{"mode": "baseline", "prompt_index": 0, "prompt_name": "p", "repeat": 0, "draft_max": None,
                 "tokens": base}]
        for tok in (close, far):
            runs.append({"mode": "speculative", "prompt_index": 0, "prompt_name": "p", "repeat": 0, "draft_max": 4,
                         "tokens": base[:5] + [tok] + base[6:]})
            (d,) = bench_lib.first_divergences(eng, [toks], runs)
            runs.pop()
            assert (d["token_index"], d["baseline_token"], d["speculative_token"]) == (5, base[5], tok)
            assert d["margin"] == pytest.approx(row[base[5]] - row[tok], abs=1e-3) and d["margin"] >= 0
            assert d["near_tie"] == (d["margin"] < bench_lib.NEAR_TIE_LOGITS)
            (line,) = divergence_lines({"divergences": [d]})
            assert "token 5" in line and ("near tie" in line if d["near_tie"] else "NOT a near tie" in line)
        assert d["near_tie"] is False  # the least likely token is never a tie on this model
        identical = runs + [dict(runs[0], mode="speculative", draft_max=4)]
        assert bench_lib.first_divergences(eng, [toks], identical) == []
