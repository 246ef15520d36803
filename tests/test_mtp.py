"""--drafter mtp: the target's own MTP head drafts; the verifier keeps the output the target's (greedy and sampled)."""

from __future__ import annotations

import ctypes

import llama_cpp.llama_cpp as C
import numpy as np
import pytest
from typer.testing import CliRunner

from specq.cli.app import app
from specq.errors import ModelFileError
from specq.native.llama import ffi as _ffi
from specq.native.runtime.engine import Engine
from specq.native.core.settings import GenerationSettings
from beside import Pair
from stats import chi2_pvalue
from test_exactness import sampled_law, target_law

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "Once upon a time"]


def generate(e, toks, speculative, **kw):
    return e.session().generate(toks, GenerationSettings(**kw), speculative=speculative).run()


def test_greedy_mtp_drafting_equals_the_target_alone(mtp_target):
    with Engine(mtp_target, None, ctx=256, threads=1, mtp=True) as e:
        assert e.mtp_ctx is not None and e.draft is None
        for p in PROMPTS:
            toks = e.tokenize(p)
            base = generate(e, toks, False, n_predict=40)
            for k in (1, 4):
                g = generate(e, toks, True, n_predict=40, draft_max=k, drafter="mtp")
                assert g.tokens == base.tokens, (p, k)
                by = dict(g.stats.n_drafted_by)
                assert set(by) == {"mtp"} and by["mtp"] == g.stats.n_drafted > 20
                assert 0 < g.stats.n_accepted < g.stats.n_drafted  # some accepted, some rejected
                assert dict(g.stats.n_accepted_by)["mtp"] == g.stats.n_accepted
            assert len(set(base.tokens)) > 20  # not degenerate


# ---- the head's input: token k paired with the trunk's hidden state of position k-1 -------------------------
def reference_mtp_rows(path, history: list[int], drafts: list[int], pair_shift: int = 1) -> np.ndarray:
    """The MTP head's logits after `history` and then after each of `drafts`, computed from scratch: the trunk's
    hidden states from one embeddings pass (llama_get_embeddings_ith, not the engine's path), the head fed
    (t_k, h_{k-pair_shift}) for every position, then each draft with the head's own output state."""
    _ffi.ensure_backend()
    params = C.llama_model_default_params()
    params.load_mtp = True
    model = C.llama_model_load_from_file(str(path).encode(), params)
    tgt = mtp = None
    try:
        cp = C.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max, cp.n_threads, cp.n_threads_batch = 1024, 1024, 1024, 1, 1, 1
        cp.embeddings = True
        tgt = C.llama_init_from_model(model, cp)
        n, n_embd = len(history), C.llama_model_n_embd(model)
        buf = (C.llama_token * n)(*history)
        assert C.llama_decode(tgt, C.llama_batch_get_one(buf, n)) == 0
        h = np.array([np.ctypeslib.as_array(C.llama_get_embeddings_ith(tgt, i), shape=(n_embd,)) for i in range(n)],
                     dtype=np.float32)
        cp.embeddings = False
        cp.ctx_type = C.LLAMA_CONTEXT_TYPE_MTP
        mtp = C.llama_init_from_model(model, cp)
        from llama_cpp import llama_cpp_ext as X
        X.llama_set_embeddings_nextn(mtp, True, True)  # masked, one output row per batch
        n_vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(model))

        def run(pairs, pos0):
            batch = C.llama_batch_ext_init(mtp)
            try:
                for i, (tok, row) in enumerate(pairs):
                    idx = C.llama_batch_ext_add_token(batch, 0, tok)
                    pos = C.llama_pos(pos0 + i)
                    C.llama_batch_ext_set_pos(batch, idx, ctypes.byref(pos))
                    row = np.ascontiguousarray(row, np.float32)
                    C.llama_batch_ext_set_embd_token(batch, idx, C.llama_embd(
                        row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, row.size))
                    C.llama_batch_ext_set_output_logits(batch, idx, i == len(pairs) - 1)
                assert C.llama_process(mtp, C.LLAMA_PROCESS_TYPE_DECODE, batch) == 0
            finally:
                C.llama_batch_ext_free(batch)
            logits = np.ctypeslib.as_array(C.llama_get_logits_ith(mtp, -1), shape=(n_vocab,)).copy()
            state = np.ctypeslib.as_array(X.llama_get_embeddings_nextn_ith(mtp, -1), shape=(n_embd,)).copy()
            return logits, state

        zero = np.zeros(n_embd, np.float32)
        pairs = [(history[k], h[k - pair_shift] if k - pair_shift >= 0 else zero) for k in range(n)]
        if n > 1:
            run(pairs[:-1], 0)
        logits, state = run(pairs[-1:], n - 1)  # alone: its state is the batch's only row
        out = [logits]
        for i, d in enumerate(drafts):
            logits, state = run([(d, state)], n + i)
            out.append(logits)
        return np.array(out)
    finally:
        for c in (mtp, tgt):
            if c:
                C.llama_free(c)
        C.llama_model_free(model)


def engine_mtp_rows(ses, n_drafts: int) -> tuple[list[int], np.ndarray]:
    """The engine's MTP drafter after the session's history: its logits rows and greedy drafts."""
    mtp = ses.drafters["mtp"]
    a = mtp.missing_from()
    if a is not None:
        ses.tgt.truncate(a)
        ses.tgt.extend(ses.history[len(ses.tgt.tokens):-1], logits="none")
    mtp.begin()
    rows, drafts = [np.array(mtp.ctx.logits())], []
    try:
        for i in range(n_drafts):
            drafts.append(int(rows[-1].argmax()))
            mtp.advance(drafts[-1], i + 1)
            rows.append(np.array(mtp.ctx.logits()))
    finally:
        mtp.end()
    return drafts, np.array(rows)


def test_the_head_sees_each_token_with_the_trunk_state_before_it(mtp_target):
    """At several points of a speculative generation (a long prompt that the head catches up on in pieces, after
    partial acceptances, after a rollback), the drafter's logits are the head's from a fresh evaluation."""
    long_prompt = " ".join(PROMPTS * 10)
    with Engine(mtp_target, None, ctx=1024, threads=1, mtp=True, n_batch=128) as e:
        ses = e.session()
        toks = e.tokenize(long_prompt)
        assert len(toks) > 300  # past FLUSH_ROWS: the head catches up while the prompt is evaluated
        checked = 0
        gen = ses.generate(toks, GenerationSettings(n_predict=24, draft_max=3, drafter="mtp"))
        for i, _ in enumerate(gen):
            if i % 7 == 3:
                drafts, rows = engine_mtp_rows(ses, 2)
                ref = reference_mtp_rows(mtp_target, ses.history, drafts)
                np.testing.assert_allclose(rows, ref, atol=2e-3, rtol=1e-3)
                checked += 1
        assert checked >= 3 and gen.stats.n_drafted > 0
        # the check can fail: the same history with token k paired with h_k instead of h_{k-1}
        wrong = reference_mtp_rows(mtp_target, ses.history, drafts, pair_shift=0)
        assert np.abs(wrong - ref).max() > 0.05
        assert len(ses.drafters["mtp"].rows.rows) <= 8  # trunk rows are dropped once the head has consumed them

        ses.rollback(len(ses.history) - 10)  # the rows the head needs now were dropped: the target re-evaluates
        drafts, rows = engine_mtp_rows(ses, 2)
        np.testing.assert_allclose(rows, reference_mtp_rows(mtp_target, ses.history, drafts), atol=2e-3, rtol=1e-3)


def test_beside_another_the_head_sees_each_token_with_the_trunk_state_before_it(mtp_target):
    """The same on sequence 1 of a batch of two: its head is fed its own rows of each batched verify, paired as
    alone."""
    with Engine(mtp_target, None, ctx=1024, threads=1, mtp=True, n_batch=128, parallel=2) as e:
        pair = Pair(e, e.tokenize(" ".join(PROMPTS * 10)), GenerationSettings(n_predict=24, draft_max=3,
                                                                                drafter="mtp"))
        ses, checked, i = pair.g.session, 0, 0
        while pair.g in pair.batch.live:
            pair.step()
            i += 1
            if i % 3 == 2 and pair.g in pair.batch.live:
                drafts, rows = engine_mtp_rows(ses, 2)
                np.testing.assert_allclose(rows, reference_mtp_rows(mtp_target, ses.history, drafts), atol=2e-3,
                                           rtol=1e-3)
                checked += 1
        pair.check_shared()
    assert checked >= 3 and pair.g.stats.n_drafted > 0


def test_missing_trunk_rows_are_evaluated_again_and_the_output_stays_exact(mtp_target):
    with Engine(mtp_target, None, ctx=256, threads=1, mtp=True) as e:
        ses = e.session()
        s = GenerationSettings(n_predict=16, draft_max=3, drafter="mtp")
        ses.generate(e.tokenize(PROMPTS[0]), s).run()
        ses.rollback(len(ses.history) - 6)  # a hybrid target re-evaluates from a checkpoint: rows come back
        ses.generate(e.tokenize(PROMPTS[1]), s).run()
        assert ses.drafters["mtp"].n_redecodes == 0
        # the head behind the target with the rows it needs gone (what a target memory that drops positions
        # without re-evaluating them would leave after a rollback)
        ses.rollback(len(ses.history) - 6)
        ses.drafters["mtp"].truncate(len(ses.history) - 8)
        ses.drafters["mtp"].rows.drop_before(len(ses.history))
        again = ses.generate(e.tokenize(PROMPTS[2]), s).run()
        assert ses.drafters["mtp"].n_redecodes == 1 and again.stats.n_drafted > 0
        hist = list(ses.history)
    with Engine(mtp_target, None, ctx=256, threads=1) as ref:
        alone = ref.session().generate(hist[:-16], GenerationSettings(n_predict=16), speculative=False).run()
    assert alone.tokens == again.tokens


# ---- sampled: the output law stays the target's --------------------------------------------------------------
def test_sampled_mtp_drafting_keeps_the_joint_law_of_three_tokens(mtp_target):
    # the first token is the target's prefill's own; the second is drafted by the head, the third the bonus
    kw = dict(temp=1.0, top_k=4, top_p=1.0, min_p=0.0)
    with Engine(mtp_target, None, ctx=128, threads=1, mtp=True) as e:
        toks = e.tokenize(PROMPTS[0])
        law = target_law(mtp_target, toks, 3, top_k=4)
        counts, stats = sampled_law(e, toks, 2500, 3, n_predict=3, draft_max=1, drafter="mtp", **kw)
    drafted = sum(dict(st.n_drafted_by).get("mtp", 0) for st in stats)
    accepted = sum(st.n_accepted for st in stats)
    assert len(law) == 64 and drafted == 2500  # every generation verified one MTP draft
    assert 300 < accepted < 2200  # accepted often, rejected often: both branches of the rule ran
    assert chi2_pvalue(counts, law) > 0.001


# ---- a target without an MTP head ----------------------------------------------------------------------------
def test_a_target_without_mtp_layers_is_refused(tiny_qwen35, tiny_target):
    for path in (tiny_qwen35, tiny_target):
        with pytest.raises(ModelFileError, match="no MTP layers"):
            Engine(path, None, ctx=64, threads=1, mtp=True)
    r = CliRunner().invoke(app, ["bench", "--target", str(tiny_qwen35), "--drafter", "mtp", "--n-predict", "4"])
    assert r.exit_code == 1, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specq: error: the target has no MTP layers"), r.stderr
