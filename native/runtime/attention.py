"""The CPU's attention path with a KV stream per sequence, chosen by measuring this machine once.

With `--parallel N` on the CPU each sequence keeps a stream of its own (config.kv_streams), and whether llama.cpp's
flash-attention kernel or the plain one steps such a batch faster depends on the CPU, not on a rule: on an Intel
Xeon (AVX-512, AMX) the plain kernel was 1.45-2.4x faster for a 4-sequence step (docs/benchmarks.md, "On an Intel
Xeon"), on an AMD EPYC (AVX-512) flash attention was 7-11% faster at 100-2000 tokens on the deep target and 3-5%
faster up to 1000 tokens, 16% slower at 4000, on the demo target (issue 53's section). So `--flash-attn auto`
there times one plain step of N sequences both ways, on the loaded weights, in two small contexts (PROBE_DEPTH
cached tokens each), and takes flash attention only where it is PROBE_GAIN faster there and not PROBE_GAIN slower
at PROBE_DEPTHS[1]. The
answer is kept in specq's cache folder (attention.json) by CPU, model file, threads and N, so the probe runs once.
A model whose plain step costs under PROBE_MIN_MS is not worth the probe (its timings are mostly noise): it keeps
the plain kernel and nothing is written."""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ... import atomic
from ...errors import SpecqError
from ...machine import cache_dir, cpu_name
from ..llama import ffi as _ffi

log = logging.getLogger("specq.attention")

PROBE_DEPTHS = (512, 2048)  # cached tokens per sequence: the short end of what users run, then deeper
PROBE_BATCH = 512  # prompt rows a decode while the probe fills its contexts
PROBE_STEPS = 7  # timed steps each way, alternating, after one warm-up each (medians)
PROBE_MIN_MS = 20.0  # a plain step cheaper than this: the plain kernel, no probe
PROBE_GAIN = 0.05  # flash attention must step this much faster at the short depth, and not this much slower deeper
CACHE_NAME = "attention.json"
CACHE_MAX = 64  # entries kept (the oldest go)
PROBE_TOKEN = 1  # what the timed rows decode (any token costs the same)


@dataclass(frozen=True)
class AttentionProbe:
    """What the probe found: the path taken, a plain step's median time each way (`on_ms` None: not timed, the
    step was under PROBE_MIN_MS), and whether this came from the cache."""

    choice: str  # "on" | "off"
    off_ms: float
    on_ms: float | None
    deep_off_ms: float | None = None  # the same at `deep` tokens (None: not timed, flash attention lost short)
    deep_on_ms: float | None = None
    deep: int | None = None
    cached: bool = False

    def describe(self, n_seq: int) -> str:
        how = "remembered from an earlier run" if self.cached else "measured now"
        if self.on_ms is None:
            return (f"attention path: the plain kernel (a step of {n_seq} sequences costs {self.off_ms:.1f} ms, "
                    f"under the {PROBE_MIN_MS:.0f} ms worth a probe)")
        far = "" if self.deep_on_ms is None else \
            f"; at {self.deep}: {self.deep_on_ms:.1f} ms on, {self.deep_off_ms:.1f} ms off"
        return (f"attention path: flash attention {self.choice} with a KV stream per sequence (a step of {n_seq} "
                f"sequences at {PROBE_DEPTHS[0]} tokens each: {self.on_ms:.1f} ms on, {self.off_ms:.1f} ms off{far}; "
                f"{how})")


def deep_depth(n_ctx: int) -> int:
    """How deep the probe's second depth goes in a context of n_ctx tokens a sequence (its steps must fit)."""
    return min(PROBE_DEPTHS[1], n_ctx - PROBE_STEPS - 2)


def probe_key(model_path: str, threads: int, n_seq: int, n_ctx: int) -> str:
    """The cache's key: what the answer depends on (the CPU, the model file as it is now, threads, sequences, and
    how deep the probe could go)."""
    st = os.stat(model_path)
    return (f"{cpu_name()}|{os.path.realpath(model_path)}|{st.st_size}|{st.st_mtime_ns}|t{threads}|n{n_seq}"
            f"|d{deep_depth(n_ctx)}")


def cache_path() -> Path:
    return cache_dir() / CACHE_NAME


def read_cache() -> dict:
    """The cached answers; an unreadable or foreign file counts as empty (the probe runs again and rewrites it)."""
    try:
        got = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


def _cached(entry) -> AttentionProbe | None:
    if not isinstance(entry, dict) or entry.get("choice") not in ("on", "off"):
        return None
    def maybe(cast, key):
        return None if entry.get(key) is None else cast(entry[key])

    try:  # the short depth's two times are always there; the deeper ones where they were taken
        return AttentionProbe(entry["choice"], float(entry["off_ms"]), float(entry["on_ms"]),
                              maybe(float, "deep_off_ms"), maybe(float, "deep_on_ms"), maybe(int, "deep"), cached=True)
    except (KeyError, TypeError, ValueError):
        return None


def _remember(key: str, probe: AttentionProbe) -> None:
    entries = read_cache()
    entries.pop(key, None)
    entries[key] = {**{k: v for k, v in asdict(probe).items() if k != "cached"}, "when": time.strftime("%Y-%m-%d")}
    kept = dict(list(entries.items())[-CACHE_MAX:])
    try:
        cache_path().parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(cache_path(), json.dumps(kept, indent=1) + "\n", what="attention cache")
    except Exception as e:  # noqa: BLE001 - a cache that cannot be written costs a probe next time, nothing more
        log.debug("attention cache not written: %s", e)


def choose_attention(model: _ffi.Model, threads: int, n_seq: int, n_ctx: int) -> AttentionProbe | None:
    """The attention path for N sequences with a stream each on the CPU, each up to n_ctx tokens: the cached
    answer, else a probe; None where the probe could not run (its two contexts did not fit in memory, a decode
    failed): one warning, and the caller keeps its rule. The probe never stops a model from loading."""
    key = probe_key(str(model.path), threads, n_seq, n_ctx)
    hit = _cached(read_cache().get(key))
    if hit is not None:
        return hit
    try:
        probe = measure(model, threads, n_seq, n_ctx)
    except SpecqError as e:
        log.warning("attention path not measured (%s); the plain kernel, as --flash-attn off", e)
        return None
    if probe.on_ms is not None:
        _remember(key, probe)
    return probe


def _time_step(ctx: _ffi.Context, n_seq: int, pos: int) -> float:
    """One plain step of every sequence (a row each at `pos`), its logits read: seconds."""
    t0 = time.perf_counter()
    ctx.decode_seqs([(s, [PROBE_TOKEN], pos, "last") for s in range(n_seq)])
    ctx.logits(1, seq=n_seq - 1)
    return time.perf_counter() - t0


def _context(model: _ffi.Model, threads: int, n_seq: int, flash_attn: str, n_ctx: int) -> _ffi.Context:
    return _ffi.Context(model, n_ctx, threads, n_batch=max(PROBE_BATCH, n_seq), n_outputs_max=n_seq,
                        name=f"attention probe ({flash_attn})", flash_attn=flash_attn, n_seq=n_seq, unified=False)


def _fill(ctx: _ffi.Context, n_seq: int, depth: int) -> None:
    """Every sequence holds positions 0..depth-1: what the first holds beyond its last depth (the timed rows go),
    evaluated up to `depth`, then copied to the others (a stream each: the whole stream is copied)."""
    held = min(ctx.pos_max(0) + 1, depth)
    ctx.seq_rm(held, -1, seq=0)
    tokens = [(7 * i) % (ctx.n_vocab - 2) + 1 for i in range(depth)]
    for a in range(held, depth, PROBE_BATCH):
        ctx.decode(tokens[a:a + PROBE_BATCH], a, logits="none", seq=0)
    for s in range(1, n_seq):
        ctx.seq_cp(0, s)


def _time_both(ctxs: dict[str, _ffi.Context], n_seq: int, depth: int) -> dict[str, float]:
    """PROBE_STEPS plain steps each way after a warm-up each, alternating: median milliseconds by path."""
    times: dict[str, list[float]] = {fa: [] for fa in ctxs}
    for fa in ctxs:
        _fill(ctxs[fa], n_seq, depth)
        _time_step(ctxs[fa], n_seq, depth)  # warm-up
    for i in range(1, PROBE_STEPS + 1):
        for fa in sorted(ctxs, reverse=bool(i % 2)):
            times[fa].append(_time_step(ctxs[fa], n_seq, depth + i))
    return {fa: 1e3 * statistics.median(v) for fa, v in times.items()}


def measure(model: _ffi.Model, threads: int, n_seq: int, n_ctx: int) -> AttentionProbe:
    """Time a plain step of N sequences at PROBE_DEPTHS[0] with the plain kernel, then (unless it is under
    PROBE_MIN_MS) both ways, the two contexts stepping in turn so that the machine's load hits both alike; where
    flash attention is PROBE_GAIN faster there, again at the deeper PROBE_DEPTHS[1] (as far as `n_ctx` allows),
    where it must not be PROBE_GAIN slower (deeper, run-to-run spread on a 2-core EPYC was ±10%: a tie there is
    a tie, and the short depth's clear gain decides)."""
    short, deep = PROBE_DEPTHS[0], deep_depth(n_ctx)
    size = -(-(max(short, deep) + PROBE_STEPS + 2) // 256) * 256  # llama.cpp sizes caches in 256s
    ctxs: dict[str, _ffi.Context] = {}
    try:
        ctxs["off"] = _context(model, threads, n_seq, "off", size)
        _fill(ctxs["off"], n_seq, short)
        cheap = [_time_step(ctxs["off"], n_seq, short + i) for i in range(2)][1]
        if 1e3 * cheap < PROBE_MIN_MS:
            return AttentionProbe("off", 1e3 * cheap, None)
        log.info("measuring the attention path for %d sequences on this machine (once; remembered in %s)",
                 n_seq, cache_path())
        ctxs["on"] = _context(model, threads, n_seq, "on", size)
        at = _time_both(ctxs, n_seq, short)
        if at["on"] >= (1 - PROBE_GAIN) * at["off"] or deep <= short:
            return AttentionProbe("on" if at["on"] < (1 - PROBE_GAIN) * at["off"] else "off", at["off"], at["on"])
        far = _time_both(ctxs, n_seq, deep)
        return AttentionProbe("on" if far["on"] <= (1 + PROBE_GAIN) * far["off"] else "off", at["off"], at["on"],
                              far["off"], far["on"], deep)
    finally:
        for ctx in ctxs.values():
            ctx.close()
