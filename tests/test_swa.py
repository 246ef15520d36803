"""Sliding-window targets and drafts (llama.cpp arch gemma3): rejected drafts roll back exactly after the window
has slid, and a rollback further back than the cache still holds evaluates again instead of going wrong.

specq creates contexts with llama.cpp's small sliding-window cache (swa_full off): the local layers keep about
window + n_ubatch positions and reuse the cells of positions that left the window. The fixtures here make that
happen early: an 8-token window, n_ubatch 65 on the target (its floor) and 16 on the draft, so both caches hold
256 cells, and prompts of ~300 tokens in a 512-token context.
"""

from __future__ import annotations

import llama_cpp.llama_cpp as C
import numpy as np
import pytest

from beside import draft_memory
from specq.native.llama import ffi as _ffi
from specq.native.runtime.engine import Engine
from specq.native.core.settings import GenerationSettings
from stats import chi2_pvalue
from test_exactness import assert_consistent, target_law
from tinymodels import CORPUS, TinyGemma3Spec, write_tiny_gemma3

CTX = 512
SWA_CELLS = 256  # llama.cpp: pad(min(n_ctx, n_swa + n_ubatch), 256) cells for the local layers


@pytest.fixture(scope="module")
def gemma3_pair(models_dir):
    t = write_tiny_gemma3(models_dir / "gemma3.gguf", seed=51)
    d = write_tiny_gemma3(models_dir / "gemma3_close.gguf", seed=52, noise_from=(51, 0.05))
    return t, d


def engine(target, draft) -> Engine:
    return Engine(target, draft, ctx=CTX, threads=1, n_batch=16)


def long_prompt(e: Engine, n: int = 300) -> list[int]:
    """n tokens of text: longer than the window and than what the local layers' cache holds."""
    toks = e.tokenize(CORPUS * 4)
    assert len(toks) >= n
    return toks[:n]


def fresh_logits(path, tokens: list[int]) -> np.ndarray:
    """Next-token logits of `tokens` evaluated once from an empty cache (nothing rolled back)."""
    with _ffi.Model(path) as m, _ffi.Context(m, CTX, 1) as c:
        c.decode(tokens, 0, logits="last")
        return np.array(c.logits(1)[0])


def assert_memory_is_exact(cache, path):
    """The cache's next-token logits equal a fresh evaluation of its tokens: the witness on the draft side, where a
    stale cache would lower acceptance without changing the output. Tolerance: one batch against token-by-token
    decodes differ by up to 0.004 here after ~340 tokens; a local layer missing its window's keys by ~0.1."""
    toks = list(cache.tokens)
    cache.extend([7], logits="last")
    np.testing.assert_allclose(np.array(cache.ctx.logits(1)[0]), fresh_logits(path, toks + [7]), atol=2e-2)


def test_the_fixture_has_local_and_global_layers_and_its_cache_slides(gemma3_pair):
    with _ffi.Model(gemma3_pair[0]) as m:
        assert m.meta("general.architecture") == "gemma3" and not m.is_recurrent_or_hybrid
        assert C.llama_model_n_swa(m.handle) == TinyGemma3Spec().sliding_window == 8
        assert m.n_layer == 6  # llama.cpp's gemma3 pattern: layers 0-4 local, layer 5 global
        toks = m.tokenize(CORPUS * 4, add_special=False)[:300]
        for swa_full, slid in ((False, True), (True, False)):
            with _ffi.Context(m, CTX, 1, n_batch=65, swa_full=swa_full) as c:
                c.decode(toks, 0, logits="last")
                # the small cache reused the cells of the oldest positions; the full-size one keeps them all
                assert (c.pos_min() > 0) == slid and c.pos_max() == 299
                assert c.n_swa == (0 if swa_full else 8)
                if slid:
                    assert c.pos_min() == 300 - SWA_CELLS
                    assert c.window_intact(299) and not c.window_intact(c.pos_min() + 7)


def test_greedy_identity_with_rollbacks_after_the_window_slid(gemma3_pair):
    target, draft = gemma3_pair
    with engine(target, draft) as e:
        toks = long_prompt(e)
        base = e.session().generate(toks, GenerationSettings(n_predict=64), speculative=False).run()
        ses = e.session()
        g = ses.generate(toks, GenerationSettings(n_predict=64, draft_max=4)).run()
        assert len(set(base.tokens)) > 10 and g.tokens == base.tokens
        assert 0 < g.stats.n_accepted < g.stats.n_drafted  # some drafts rejected...
        # ...and rolled back on both sides from caches that had already dropped their oldest positions
        assert ses.tgt.n_rollbacks > 0 and draft_memory(ses).n_rollbacks > 0 and g.stats.n_rollbacks > 0
        assert ses.tgt.ctx.pos_min() > 0 and draft_memory(ses).ctx.pos_min() > 0
        assert g.stats.n_restores == 0  # every step's rollback stayed within what the caches hold
        assert_consistent(ses)
        assert_memory_is_exact(ses.tgt, target)
        assert_memory_is_exact(draft_memory(ses), draft)


def test_sampling_law_with_rollbacks_after_the_window_slid(gemma3_pair):
    # The joint law of three tokens: the first the target's prefill's own, then two drafted (a rejected first
    # draft is rolled back on both sides; four are generated so that the second step may draft two). One
    # session: each generation starts by cutting the history back to the prompt, outside the counted window.
    target, draft = gemma3_pair
    kw = dict(temp=1.0, top_k=4, top_p=1.0, min_p=0.0)
    with engine(target, draft) as e:
        toks = long_prompt(e)
        law = {}
        for k, p in target_law(target, toks, 3, top_k=4, ctx=CTX).items():
            # generation stops at an end-of-generation token: its continuations are one outcome
            k = next((k[:i + 1] for i, t in enumerate(k) if e.target.is_eog(t)), k)
            law[k] = law.get(k, 0.0) + p
        ses, counts, rolled = e.session(), {}, [0, 0]
        ses.generate(toks[:-1], GenerationSettings(n_predict=1), speculative=False).run()
        for seed in range(2500):
            ses.rollback(len(toks) - 1)
            before = ses.tgt.n_rollbacks, draft_memory(ses).n_rollbacks
            g = ses.generate(toks[-1:], GenerationSettings(seed=seed, n_predict=4, draft_max=2, **kw)).run()
            rolled = [rolled[0] + ses.tgt.n_rollbacks - before[0], rolled[1] + draft_memory(ses).n_rollbacks - before[1]]
            key = tuple(g.tokens[:3])
            counts[key] = counts.get(key, 0) + 1
        assert ses.tgt.ctx.pos_min() > 0 and draft_memory(ses).ctx.pos_min() > 0
        assert rolled[0] > 200 and rolled[1] > 200, rolled  # rejected drafts dropped from slid windows, both sides
        assert ses.tgt.n_restores == draft_memory(ses).n_restores == 0
    assert len(law) > 40
    assert chi2_pvalue(counts, law) > 0.001


def test_a_rollback_past_what_the_cache_holds_evaluates_again(gemma3_pair):
    # A new prompt that shares only the start of the cached one (a server's next request after the same system
    # prompt): the local layers no longer hold the positions that the first new token attends to, and llama.cpp's
    # seq_rm reports success anyway. Both caches must be rebuilt, and the answer must be the fresh one's.
    target, draft = gemma3_pair
    with engine(target, draft) as e:
        toks = long_prompt(e)
        ses = e.session()
        ses.generate(toks, GenerationSettings(n_predict=40, draft_max=4)).run()
        assert ses.tgt.ctx.pos_min() > 60 and draft_memory(ses).ctx.pos_min() > 60
        del ses.history[60:]
        kept, again = list(ses.history), e.tokenize(" again")
        g = ses.generate(again, GenerationSettings(n_predict=24, draft_max=4)).run()
        with engine(target, draft) as fresh:
            ref = fresh.session().generate(kept + again, GenerationSettings(n_predict=24), speculative=False).run()
        assert g.tokens == ref.tokens and g.stats.n_drafted > 0
        assert ses.tgt.n_restores > 0 and draft_memory(ses).n_restores > 0
        assert_consistent(ses)


# ---- the planner counts what the small sliding-window cache holds -----------------------------------------------
def write_gemma3_header(path, *, n_layer: int, n_embd: int, n_head_kv: int, head_dim: int, window: int):
    """Header + tensor infos of a Gemma-3-shaped GGUF; the data is a sparse hole."""
    import os

    import gguf
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(131072)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(4 * n_embd)
    w.add_head_count(2 * n_head_kv)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(window)  # no pattern key: llama.cpp's gemma3 default, every 6th layer global
    w.add_vocab_size(1024)
    f32 = np.dtype(np.float32)

    def t(name, *shape):  # numpy order (the ggml shape reversed)
        w.add_tensor_info(name, shape, f32, 4 * int(np.prod(shape)))

    d, q, kv, ff = n_embd, 2 * n_head_kv * head_dim, n_head_kv * head_dim, 4 * n_embd
    t("token_embd.weight", 1024, d)
    for i in range(n_layer):
        b = f"blk.{i}."
        for name in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            t(b + name + ".weight", d)
        t(b + "attn_q.weight", q, d)
        t(b + "attn_k.weight", kv, d)
        t(b + "attn_v.weight", kv, d)
        t(b + "attn_output.weight", d, q)
        t(b + "attn_q_norm.weight", head_dim)
        t(b + "attn_k_norm.weight", head_dim)
        t(b + "ffn_gate.weight", ff, d)
        t(b + "ffn_up.weight", ff, d)
        t(b + "ffn_down.weight", d, ff)
    t("output_norm.weight", d)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    total = sum(gguf.GGUFWriter.ggml_pad(ti.nbytes, w.data_alignment) for t in w.tensors for ti in t.values())
    with open(path, "r+b") as f:
        f.truncate(gguf.GGUFWriter.ggml_pad(os.path.getsize(path), w.data_alignment) + total)
    return path


def test_the_planner_counts_local_layers_at_window_plus_ubatch(tmp_path):
    from specq.native.commands import plan as P
    # Gemma-3-27B's attention shape: 62 layers (10 global), 16 KV heads of 128, a 1024-token window
    path = write_gemma3_header(tmp_path / "g27.gguf", n_layer=62, n_embd=5376, n_head_kv=16, head_dim=128,
                               window=1024)
    shape = P.model_shape(str(path))
    assert shape.swa_window == 1024 and sum(not s for s in shape.swa_layers) == 10
    per_token = 2 * 16 * 128 * 2  # K and V, f16
    p = P.plan(str(path), None, [P.Device("GPU0", 200 << 30)], ctx=32768)
    # global layers at the full context, local ones at pad256(1024 + 512) = 1536 positions
    assert p.to_dict()["target"]["kv_bytes"] == per_token * (10 * 32768 + 52 * 1536)
    small = P.plan(str(path), None, [P.Device("GPU0", 200 << 30)], ctx=1024)
    assert small.to_dict()["target"]["kv_bytes"] == per_token * 62 * 1024  # the window never exceeds n_ctx


def test_the_planner_counts_a_hybrid_targets_recurrent_state_and_its_rollback_snapshots(models_dir):
    # The benchmark's "m" qwen35 shape: llama.cpp logs 1.64 MiB of recurrent memory with n_rs_seq 0 and 27.89 MiB
    # with 16 (benchmarks.md); the planner must count 17 copies on the target, one on a draft, and no KV cache on
    # the linear-attention layers.
    from specq.native.commands import plan as P
    from tinymodels import TinyQwen35Spec, write_tiny_qwen35
    spec = TinyQwen35Spec(n_layer=16, n_embd=512, n_ff=1536, n_head=8, n_head_kv=2, head_dim=64, n_rot=16,
                          rope_sections=(4, 2, 2, 0), linear_k_heads=4, linear_v_heads=8, linear_head_dim=64)
    path = str(write_tiny_qwen35(models_dir / "plan_qwen35.gguf", seed=3, spec=spec))
    kd, vd = 4 * 64, 8 * 64
    one_layer = 4 * (8 * 64 * 64 + 3 * (2 * kd + vd))  # F32 state + conv window
    kv_token = 2 * 2 * 64 * 2  # K and V of 2 heads of 64, f16
    dev = [P.Device("GPU0", 64 << 30)]
    as_target = P.plan(path, None, dev, ctx=1024).to_dict()["target"]
    assert as_target["kv_bytes"] == 4 * kv_token * 1024 + 12 * one_layer * 17
    assert as_target["recurrent_bytes"] == 12 * one_layer * 17
    assert abs(12 * one_layer * 17 / 2**20 - 27.89) < 0.01 and abs(12 * one_layer / 2**20 - 1.64) < 0.01
    as_draft = P.plan(path, path, dev, ctx=1024).to_dict()["draft"]
    assert as_draft["kv_bytes"] == 4 * kv_token * 1024 + 12 * one_layer
