"""The CPU's attention path with a KV stream per sequence (runtime/attention.py): `--flash-attn auto` times a plain
step of N sequences both ways on the loaded weights, takes the faster (flash attention only where it is
PROBE_GAIN faster), remembers it in specq's cache folder, and leaves a model too cheap to time on the plain kernel."""

from __future__ import annotations

import json

import pytest

from specq.native.runtime import attention
from specq.native.core.settings import GenerationSettings
from specq.native.runtime.engine import Engine

from test_parallel import PROMPTS, alone, together


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECQ_CACHE_DIR", str(tmp_path))
    return tmp_path / attention.CACHE_NAME


def priced(monkeypatch, on_ms: float, off_ms: float, deep: tuple[float, float] | None = None) -> dict[str, int]:
    """Each probe step still decodes for real (counted by path, and `deep` ones apart); its time is the price
    given (`deep`: (on, off) at the probe's deeper depth)."""
    real, steps = attention._time_step, {"on": 0, "off": 0, "deep": 0}

    def step(ctx, n_seq, pos):
        fa = "on" if ctx.name.endswith("(on)") else "off"
        real(ctx, n_seq, pos)
        steps[fa] += 1
        far = pos >= attention.PROBE_DEPTHS[1] - 16
        steps["deep"] += far
        return ((deep if far else (on_ms, off_ms))[fa == "off"]) / 1e3

    monkeypatch.setattr(attention, "_time_step", step)
    monkeypatch.setattr(attention, "PROBE_MIN_MS", 0.0)
    return steps


def test_the_probe_takes_the_faster_path_and_remembers_it(tiny_target, cache, monkeypatch):
    steps = priced(monkeypatch, on_ms=30.0, off_ms=40.0)
    with Engine(tiny_target, ctx=128, threads=1, parallel=3) as e:
        assert not e.tgt_ctx.unified and e.flash_attn == "on"
        assert e.attention_probe == attention.AttentionProbe("on", 40.0, 30.0)
    assert steps["on"] >= attention.PROBE_STEPS and steps["off"] >= attention.PROBE_STEPS
    entry = json.loads(cache.read_text())
    assert [v["choice"] for v in entry.values()] == ["on"]

    ran = dict(steps)
    with Engine(tiny_target, ctx=128, threads=1, parallel=3) as e:  # remembered: no probe
        assert e.flash_attn == "on" and e.attention_probe.cached
    assert steps == ran

    with Engine(tiny_target, ctx=128, threads=1, parallel=2) as e:  # another N is another question
        assert e.attention_probe.cached is False
    assert steps["on"] > ran["on"]


def test_flash_attention_must_be_clearly_faster(tiny_target, cache, monkeypatch):
    priced(monkeypatch, on_ms=39.0, off_ms=40.0)  # 2.5% faster: under PROBE_GAIN
    with Engine(tiny_target, ctx=128, threads=1, parallel=2) as e:
        assert e.flash_attn == "off" and e.attention_probe.choice == "off"
    cache.unlink()
    priced(monkeypatch, on_ms=50.0, off_ms=40.0)
    with Engine(tiny_target, ctx=128, threads=1, parallel=2) as e:
        assert e.flash_attn == "off" and e.attention_probe.on_ms == 50.0


def test_flash_attention_must_not_lose_deeper_where_the_context_reaches(tiny_target, cache, monkeypatch):
    steps = priced(monkeypatch, on_ms=30.0, off_ms=40.0, deep=(85.0, 80.0))  # 6% slower deeper
    with Engine(tiny_target, ctx=2200, threads=1, parallel=2) as e:
        p = e.attention_probe
        assert e.flash_attn == "off" and (p.on_ms, p.off_ms, p.deep_on_ms, p.deep_off_ms) == (30, 40, 85, 80)
        assert p.deep == attention.PROBE_DEPTHS[1] and steps["deep"] >= 2 * attention.PROBE_STEPS
    cache.unlink()
    steps = priced(monkeypatch, on_ms=30.0, off_ms=40.0, deep=(83.0, 80.0))  # a tie deeper (under PROBE_GAIN)
    with Engine(tiny_target, ctx=2200, threads=1, parallel=2) as e:
        assert e.flash_attn == "on" and e.attention_probe.deep_on_ms == 83
    with Engine(tiny_target, ctx=2200, threads=1, parallel=2) as e:  # remembered whole
        assert e.attention_probe == attention.AttentionProbe("on", 40, 30, 80, 83, attention.PROBE_DEPTHS[1], True)
    steps = priced(monkeypatch, on_ms=30.0, off_ms=40.0, deep=(90.0, 80.0))
    with Engine(tiny_target, ctx=1000, threads=1, parallel=2) as e:  # as deep as the context goes
        assert e.attention_probe.deep == 1000 - attention.PROBE_STEPS - 2 and e.flash_attn == "on"
    assert steps["deep"] == 0


def test_answers_stay_exact_on_the_path_the_probe_chose(tiny_target, tiny_close, cache, monkeypatch):
    steps = priced(monkeypatch, on_ms=10.0, off_ms=20.0)
    lengths = [30, 12, 26]
    want = alone(tiny_target, PROMPTS[:3], lengths, flash_attn="on")
    with Engine(tiny_target, tiny_close, ctx=256, threads=1, parallel=3) as e:
        assert e.flash_attn == "on" and steps["on"] > 0
        gens = together(e, PROMPTS[:3], lengths, late=1, draft_max=4)
        for g, w in zip(gens, want):
            assert len(set(w)) > 5 and g.tokens == w
            assert g.stats.n_drafted > 0


def test_real_timings_choose_by_the_rule(tiny_target, cache, monkeypatch):
    monkeypatch.setattr(attention, "PROBE_MIN_MS", 0.0)
    with Engine(tiny_target, ctx=128, threads=1, parallel=2) as e:
        p = e.attention_probe
        assert p.off_ms > 0 and p.on_ms > 0 and not p.cached
        assert e.flash_attn == p.choice == ("on" if p.on_ms < (1 - attention.PROBE_GAIN) * p.off_ms else "off")


def test_a_model_too_cheap_to_time_keeps_the_plain_kernel_and_writes_nothing(tiny_target, cache):
    with Engine(tiny_target, ctx=128, threads=1, parallel=2) as e:
        assert e.flash_attn == "off" and e.attention_probe.on_ms is None
        assert e.attention_probe.off_ms < attention.PROBE_MIN_MS
    assert not cache.exists()


def test_a_corrupt_cache_is_measured_again_and_rewritten(tiny_target, cache, monkeypatch):
    cache.write_text("{not json")
    steps = priced(monkeypatch, on_ms=30.0, off_ms=40.0)
    with Engine(tiny_target, ctx=128, threads=1, parallel=2) as e:
        assert e.flash_attn == "on" and not e.attention_probe.cached
    assert steps["on"] > 0 and list(json.loads(cache.read_text()).values())[0]["choice"] == "on"
    key = next(iter(json.loads(cache.read_text())))
    cache.write_text(json.dumps({key: {"choice": "sideways", "off_ms": 1, "on_ms": 2}}))
    with Engine(tiny_target, ctx=128, threads=1, parallel=2) as e:
        assert not e.attention_probe.cached and e.flash_attn == "on"


def test_a_probe_that_cannot_run_leaves_the_rule_and_the_model_loads(tiny_target, cache, monkeypatch, caplog):
    from specq.errors import SpecqError

    priced(monkeypatch, on_ms=30.0, off_ms=40.0)
    tried = []

    def no_room(model, threads, n_seq, flash_attn, n_ctx):
        tried.append(flash_attn)
        raise SpecqError("llama.cpp could not create a context (n_ctx=2048)")

    monkeypatch.setattr(attention, "_context", no_room)
    with caplog.at_level("WARNING", logger="specq.attention"):
        with Engine(tiny_target, ctx=128, threads=1, parallel=2) as e:
            assert e.flash_attn == "off" and e.attention_probe is None and tried == ["off"]
            g = e.session().generate(e.tokenize("def f(x):"), GenerationSettings(n_predict=4), speculative=False)
            assert len(g.run().tokens) == 4
    assert "attention path not measured" in caplog.text and not cache.exists()


def test_no_probe_where_the_flag_or_the_layout_decides(tiny_target, cache, monkeypatch):
    steps = priced(monkeypatch, on_ms=30.0, off_ms=40.0)
    with Engine(tiny_target, ctx=128, threads=1, parallel=2, flash_attn="off") as e:
        assert e.flash_attn == "off" and e.attention_probe is None
    with Engine(tiny_target, ctx=128, threads=1) as e:  # one sequence: the rule (plain kernel on the CPU)
        assert e.flash_attn == "off" and e.attention_probe is None
    assert steps == {"on": 0, "off": 0, "deep": 0}
