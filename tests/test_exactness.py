"""Exactness at the edges: interrupted steps, small batches, a draft vocabulary larger than the target's, the
bonus token's law, end of generation, and draft lengths beyond 8."""

from __future__ import annotations

import numpy as np
import pytest

import tinymodels
from specq.native.llama import ffi as _ffi
from specq.native.runtime.engine import Engine, SimulatedClock
from specq.native.core.settings import GenerationSettings
from beside import beside, spy_steps, draft_memory
from stats import chi2_pvalue
from test_hybrid import write_tiny_mamba
from tinymodels import TinySpec, write_tiny_gguf

PROMPT = "def fibonacci(n):"
WHERE = pytest.mark.parametrize("beside_another", [False, True], ids=["alone", "beside"])


def generate(e, toks: list[int], settings: GenerationSettings, beside_another: bool = False):
    """One generation run alone, or on sequence 1 with a neighbour sharing each of its steps (an engine with
    parallel=2, tests/beside.py): the speculative step's two uses, one rule."""
    return beside(e, toks, settings) if beside_another else e.session().generate(toks, settings).run()


def assert_consistent(ses):
    """Each memory holds exactly its token list, and that list is a prefix of what was committed."""
    for cache, committed in ((ses.tgt, ses.history[:-1]), (draft_memory(ses), ses.history)):
        if cache is None:
            continue
        assert cache.ctx.pos_max() == len(cache.tokens) - 1, (cache.ctx.name, cache.ctx.pos_max(), len(cache.tokens))
        assert cache.tokens == committed[:len(cache.tokens)], cache.ctx.name


# ---- 1. an exception after any llama.cpp call of a step leaves both caches consistent ---------------------
class Interrupter:
    """Wraps the llama.cpp-facing calls; raises KeyboardInterrupt right after the `at`-th call returns, in the
    gap where chat's second Ctrl-C lands (the C call done, the bookkeeping not yet)."""

    CALLS = [(_ffi.Context, "decode"), (_ffi.Context, "logits"), (_ffi.Context, "state_get"),
             (_ffi.Context, "state_set"), (_ffi.Context, "seq_rm"), (_ffi.Sampler, "sample"),
             (_ffi.TransformChain, "apply")]

    def __init__(self, monkeypatch):
        self.n = 0
        self.at = None
        self.fired = []
        for cls, name in self.CALLS:
            monkeypatch.setattr(cls, name, self._wrap(getattr(cls, name), name))

    def _wrap(self, fn, name):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            self.n += 1
            if self.n == self.at:
                self.fired.append(name)
                raise KeyboardInterrupt
            return out
        return call


@pytest.fixture(scope="module")
def mamba_pair(models_dir):
    t = write_tiny_mamba(models_dir / "x_mamba_t.gguf", seed=21)
    d = write_tiny_mamba(models_dir / "x_mamba_d.gguf", seed=22, noise_from=(21, 0.3))
    return t, d


@pytest.mark.parametrize("kind, temp", [("llama", 0.0), ("llama", 1.0), ("mamba", 0.0)])
def test_an_interruption_after_any_llama_call_leaves_both_caches_consistent(kind, temp, tiny_target, tiny_close,
                                                                             mamba_pair, monkeypatch):
    target, draft = (tiny_target, tiny_close) if kind == "llama" else mamba_pair
    s = GenerationSettings(n_predict=10, draft_max=4, temp=temp, seed=3)
    more = GenerationSettings(n_predict=12, draft_max=4)
    with Engine(target, draft, ctx=256, threads=1) as e:
        first, second = e.tokenize(PROMPT), e.tokenize(" return")
        hook = Interrupter(monkeypatch)
        e.session().generate(first, s).run()
        total, hook.n = hook.n, 0
        assert total > 20
        for at in range(1, total + 1):
            ses = e.session()
            hook.n, hook.at = 0, at
            try:
                ses.generate(first, s).run()
            except KeyboardInterrupt:
                pass
            hook.at = None
            assert_consistent(ses)
            history = list(ses.history)
            g = ses.generate(second, more).run()  # the next turn on the same caches
            ref = e.session().generate(history + second, more, speculative=False).run()
            assert g.tokens == ref.tokens, f"after an interruption at call {at} ({hook.fired[-1:]})"
        assert len(hook.fired) == total  # every call was interrupted once
        assert {"decode", "logits"} <= set(hook.fired)
        if kind == "mamba":
            assert {"state_get", "state_set"} <= set(hook.fired)
        if temp > 0:
            assert "apply" in hook.fired


# ---- 2. a verify batch is one decode with all its rows, whatever n_batch ------------------------------------
@WHERE
def test_small_n_batch_still_verifies_every_row(tiny_target, tiny_close, beside_another):
    with Engine(tiny_target, tiny_close, ctx=256, threads=1, n_batch=4, parallel=1 + beside_another) as e:
        toks = e.tokenize(PROMPT)
        base = e.session().generate(toks, GenerationSettings(n_predict=48), speculative=False).run()
        g = generate(e, toks, GenerationSettings(n_predict=48, draft_max=8), beside_another)
    assert len(set(base.tokens)) > 5
    assert g.tokens == base.tokens
    assert g.stats.accepted_per_pos[4] > 0  # some steps verified more than n_batch tokens and used them


def test_a_batch_with_all_logits_is_never_split(tiny_target):
    from specq.errors import SpecqError

    with _ffi.Model(tiny_target) as m, _ffi.Context(m, 64, 1, n_batch=4, n_outputs_max=8) as c:
        with pytest.raises(SpecqError, match="batch size"):
            c.decode([5, 6, 7, 8, 9], 0, logits="all")


# ---- 3. a draft vocabulary larger than the target's keeps rejection sampling exact --------------------------
KW1 = dict(temp=1.0, top_k=0, top_p=1.0, min_p=0.0)


@pytest.fixture(scope="module")
def wide_draft(models_dir, monkeypatch_module):
    """tiny_target's weights plus noise, with 24 extra vocabulary rows whose logits are large: the draft puts
    about 58% of its mass after the prompt on ids the target does not have (llama.cpp allows 128 more)."""
    saved = tinymodels.weights

    def boosted(spec, n_rows, seed):
        w = saved(spec, n_rows, seed)
        if spec.extra_rows:
            w["output.weight"][-spec.extra_rows:] *= 3.0
        return w

    monkeypatch_module.setattr(tinymodels, "weights", boosted)
    return write_tiny_gguf(models_dir / "wide_draft.gguf", seed=31, noise_from=(1, 0.1), spec=TinySpec(extra_rows=24))


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def target_law(path, tokens: list[int], depth: int, top_k: int = 0, ctx: int = 128, allowed=None) -> dict:
    """The target's own sampling law of the next `depth` tokens (temp 1, optional top-k), computed with numpy on
    its logits: a reference that shares nothing with the engine's sampling or acceptance code. A generation ends
    at an end-of-generation token: its key is shorter there. `allowed(model, first)`: a boolean mask over the
    vocabulary applied to every row (a grammar written by hand; `first`: the row of the first generated token)."""
    law = {}
    with _ffi.Model(path) as m, _ffi.Context(m, ctx, 1) as c:
        def probs(prefix):
            c.clear()
            c.decode(prefix, 0)
            z = np.array(c.logits(1)[0], np.float64)
            if top_k:
                z[np.argsort(z)[:-top_k]] = -np.inf
            if allowed is not None:
                z[~allowed(m, len(prefix) == len(tokens))] = -np.inf
            e = np.exp(z - z.max())
            return e / e.sum()

        def walk(prefix, prob, left):
            if left == 0 or (len(prefix) > len(tokens) and m.is_eog(prefix[-1])):
                law[tuple(prefix[len(tokens):])] = prob
                return
            p = probs(prefix)
            for t in np.flatnonzero(p > 0):
                walk(prefix + [int(t)], prob * float(p[t]), left - 1)
        walk(list(tokens), 1.0, depth)
    return law


def sampled_law(e, toks: list[int], n: int, depth: int, beside_another: bool = False, **settings
                ) -> tuple[dict, list]:
    """Counts of the first `depth` generated tokens (as tuples, like target_law's keys) over n generations with
    seeds 0..n-1 on one session (or each beside a neighbour: `generate`), and each generation's stats."""
    ses, counts, stats = e.session(), {}, []
    for seed in range(n):
        ses.reset()
        s = GenerationSettings(seed=seed, **settings)
        g = generate(e, toks, s, True) if beside_another else ses.generate(toks, s).run()
        key = tuple(g.tokens[:depth])
        counts[key] = counts.get(key, 0) + 1
        stats.append(g.stats)
    return counts, stats


@WHERE
def test_a_wider_draft_vocabulary_keeps_the_law_of_a_drafted_token_exact(tiny_target, wide_draft, beside_another):
    # the first token comes from the target's prefill alone; the second is the first drafted position
    with Engine(tiny_target, wide_draft, ctx=128 + 128 * beside_another, threads=1,
                parallel=1 + beside_another) as e:
        assert e.draft.n_vocab == e.target.n_vocab + 24
        toks = e.tokenize(PROMPT)
        law = target_law(tiny_target, toks, 2)
        counts, stats = sampled_law(e, toks, 3000, 2, beside_another, n_predict=3, draft_max=1, **KW1)
        drafted = sum(st.n_drafted for st in stats)
    assert drafted > 2000  # the draft proposed tokens (from the ids the target has)
    assert chi2_pvalue(counts, law) > 0.001


# ---- 4. the bonus token comes from the target: the joint law of the first four tokens -----------------------
def test_joint_law_of_four_tokens_with_two_drafted_is_the_targets(tiny_target, tiny_close):
    # the first token comes from the target's prefill alone, the next two are drafted, the fourth is the bonus
    kw = dict(temp=1.0, top_k=4, top_p=1.0, min_p=0.0)
    with Engine(tiny_target, tiny_close, ctx=128, threads=1) as e:
        toks = e.tokenize(PROMPT)
        law = target_law(tiny_target, toks, 4, top_k=4)
        counts, stats = sampled_law(e, toks, 4000, 4, n_predict=4, draft_max=2, **kw)
        all_accepted = sum(st.accepted_per_pos[1] > 0 for st in stats)  # both drafts accepted: a bonus 4th token
    assert len(law) == 256
    assert all_accepted > 300
    assert chi2_pvalue(counts, law) > 0.001


# ---- 4b. the adaptive controller acts on what it saw (draft length, drafter, plain steps): the law stays exact --
@pytest.mark.parametrize("drafter", ["model", "auto"])
def test_auto_length_and_auto_drafter_keep_the_joint_law_at_temperature_1(tiny_target, tiny_close, drafter):
    # draft_max auto (and --drafter auto) choose each step's length and drafter from earlier steps' outcomes, on
    # one controller for all 4,000 generations (a session keeps it): the first four tokens (the first from the
    # target's prefill, then the controller's steps) must still follow the target's law. A simulated clock makes
    # the draft cheap, so that the controller drafts whatever the load.
    kw = dict(temp=1.0, top_k=4, top_p=1.0, min_p=0.0)
    clock = SimulatedClock(lambda name, n, pos0: (0.001 if name == "draft" else 0.010 + 0.001 * n))
    with Engine(tiny_target, tiny_close, ctx=128, threads=1, clock=clock) as e:
        toks = e.tokenize(PROMPT)
        law = target_law(tiny_target, toks, 4, top_k=4)
        counts, stats = sampled_law(e, toks, 4000, 4, n_predict=4, draft_max="auto", drafter=drafter, **kw)
    assert chi2_pvalue(counts, law) > 0.001
    ks = {k for st in stats for k, _ in st.steps_by_k}
    assert {0, 1, 2} <= ks  # the controller's choices varied (k 0: plain decoding, or the last token's step)
    assert sum(st.n_drafted for st in stats) > 3000 and sum(st.n_accepted for st in stats) > 2000
    assert sum(st.n_drafted - st.n_accepted for st in stats) > 500  # rejections happened, and the law held


# ---- 5. end of generation ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eog_pair(models_dir, tiny_target):
    """tiny_target and a close draft whose end-of-generation token is one the target emits greedily at its 9th
    step (and not before): generation must stop right there, in every mode."""
    with Engine(tiny_target, ctx=128, threads=1) as e:
        toks = e.tokenize(PROMPT)
        out = e.session().generate(toks, GenerationSettings(n_predict=40), speculative=False).run().tokens
    eog = next(t for i, t in enumerate(out) if i >= 8 and t not in out[:i] and t > 3)
    t = write_tiny_gguf(models_dir / "eog_target.gguf", seed=1, eos_id=eog)
    d = write_tiny_gguf(models_dir / "eog_itself.gguf", seed=1, eos_id=eog)  # a perfect draft: steps run past it
    return t, d, eog, out.index(eog)


@pytest.mark.parametrize("speculative", [False, True])
def test_generation_ends_at_the_end_of_generation_token(eog_pair, speculative):
    t, d, eog, at = eog_pair
    with Engine(t, d, ctx=128, threads=1) as e:
        # the first drafting step drafts past the EOG (at index `at`, a draft position), so the step is cut there
        g = e.session().generate(e.tokenize(PROMPT), GenerationSettings(n_predict=40, draft_max=at + 3),
                                 speculative=speculative).run()
    assert g.stats.stop_reason == "eog"
    assert g.tokens[-1] == eog and len(g.tokens) == at + 1  # nothing follows it
    if speculative:
        # the perfect draft ran past the EOG inside a step; only what was emitted counts (the first token is the
        # target's prefill's own)
        assert g.stats.n_drafted > 0 and g.stats.n_accepted == g.stats.n_drafted == len(g.tokens) - 1


def test_beside_another_generation_ends_at_the_end_of_generation_token(eog_pair):
    t, d, eog, at = eog_pair
    with Engine(t, d, ctx=256, threads=1, parallel=2) as e:
        g = generate(e, e.tokenize(PROMPT), GenerationSettings(n_predict=40, draft_max=at + 3), True)
    assert g.stats.stop_reason == "eog" and g.tokens[-1] == eog and len(g.tokens) == at + 1
    assert g.stats.n_drafted > 0 and g.stats.n_accepted == g.stats.n_drafted == len(g.tokens) - 1


# ---- 6. draft_min and per-position counts that can fail ------------------------------------------------------
def verify_sizes(e, settings) -> list[int]:
    """The batch size of every verify pass (the target's decodes with logits at every row) of one generation."""
    sizes, real = [], e.tgt_ctx.decode

    def spy(tokens, pos0, logits="last"):
        if logits == "all":
            sizes.append(len(tokens))
        return real(tokens, pos0, logits=logits)

    e.tgt_ctx.decode = spy
    try:
        e.session().generate(e.tokenize(PROMPT), settings).run()
    finally:
        del e.tgt_ctx.decode
    return sizes


def test_draft_min_drops_short_drafts_and_only_those(tiny_target, tiny_close):
    with Engine(tiny_target, tiny_close, ctx=256, threads=1) as e:
        free = verify_sizes(e, GenerationSettings(n_predict=48, draft_max=4, p_min=0.1))
        strict = verify_sizes(e, GenerationSettings(n_predict=48, draft_max=4, p_min=0.1, draft_min=3))
    assert {2, 3} & set(free)  # p_min cut some drafts to 1 or 2 tokens...
    assert not {2, 3} & set(strict)  # ...which draft_min=3 verifies as plain steps (size 1) instead
    assert {4, 5} & set(strict)  # while the long drafts still ran


def test_beside_another_draft_min_drops_short_drafts_and_only_those(tiny_target, tiny_close, monkeypatch):
    """The same with a neighbour in each step's decodes, read from the step's own counts (the verify decode
    carries both sequences' rows)."""
    with Engine(tiny_target, tiny_close, ctx=256, threads=1, parallel=2) as e:
        toks = e.tokenize(PROMPT)
        free = spy_steps(monkeypatch, 1)
        generate(e, toks, GenerationSettings(n_predict=48, draft_max=4, p_min=0.1), True)
        strict = spy_steps(monkeypatch, 1)
        generate(e, toks, GenerationSettings(n_predict=48, draft_max=4, p_min=0.1, draft_min=3), True)
    assert {1, 2} & {d for d, _ in free}
    assert not {1, 2} & {d for d, _ in strict}
    assert {3, 4} & {d for d, _ in strict}


@WHERE
def test_accepted_per_position_counts_steps_reaching_each_position(tiny_target, tiny_close, beside_another):
    with Engine(tiny_target, tiny_close, ctx=256, threads=1, parallel=1 + beside_another) as e:
        st = generate(e, e.tokenize(PROMPT), GenerationSettings(n_predict=64, draft_max=4), beside_another).stats
    apos = st.accepted_per_pos
    assert sum(apos) == st.n_accepted  # each accepted token is counted at exactly one position
    assert apos[0] <= st.n_steps and apos[0] > apos[3] > 0  # some steps accept all 4, not all do


# ---- 7. greedy identity beyond draft-max 8, at a filling context, and when n_predict ends inside a step -----
@pytest.mark.parametrize("draft_max", [16, "auto"])
def test_greedy_identity_long_drafts_and_auto(tiny_target, tiny_close, draft_max):
    # tiny_close costs what the target does, so with real timings auto may rightly never draft: a simulated
    # clock prices the draft at a tenth of the target, so that auto drafts whatever the machine's load.
    clock = SimulatedClock(lambda name, n, pos0: (0.001 if name == "draft" else 0.010 + 0.001 * n))
    with Engine(tiny_target, tiny_close, ctx=512, threads=1, clock=clock if draft_max == "auto" else None) as e:
        for prompt in (PROMPT, "The quick brown fox"):
            toks = e.tokenize(prompt)
            base = e.session().generate(toks, GenerationSettings(n_predict=96), speculative=False).run()
            g = e.session().generate(toks, GenerationSettings(n_predict=96, draft_max=draft_max)).run()
            assert len(set(base.tokens)) > 5 and g.tokens == base.tokens
            assert g.stats.n_drafted > 0


def test_greedy_identity_while_the_context_fills(tiny_target, tiny_close):
    with Engine(tiny_target, tiny_close, ctx=64, threads=1) as e:
        toks = e.tokenize(PROMPT)
        base = e.session().generate(toks, GenerationSettings(n_predict=None), speculative=False).run()
        g = e.session().generate(toks, GenerationSettings(n_predict=None, draft_max=8)).run()
    assert base.stats.stop_reason == g.stats.stop_reason == "ctx"
    assert g.tokens == base.tokens and g.stats.n_drafted > g.stats.n_accepted > 0  # rejections near the end


@pytest.mark.parametrize("n_predict", [5, 6, 7, 13])
def test_n_predict_ending_inside_a_step(tiny_target, n_predict):
    with Engine(tiny_target, tiny_target, ctx=128, threads=1) as e:  # a perfect draft: every step is full
        toks = e.tokenize(PROMPT)
        base = e.session().generate(toks, GenerationSettings(n_predict=n_predict), speculative=False).run()
        g = e.session().generate(toks, GenerationSettings(n_predict=n_predict, draft_max=4)).run()
    assert g.tokens == base.tokens and len(g.tokens) == n_predict
    assert g.stats.stop_reason == "n_predict" and g.stats.n_accepted == g.stats.n_drafted > 0


# ---- 8. hybrid memories (attention + recurrent layers) on either side: restores run and stay exact ---------
@pytest.mark.parametrize("side, rollback", [("target", 16), ("target", 0), ("draft", 16)])
def test_a_hybrid_model_on_either_side_rolls_back_and_stays_exact(side, rollback, tiny_target, tiny_qwen35):
    # The other model is unrelated, so drafts are often rejected: the hybrid side must drop the rejected tail
    # through llama.cpp's state snapshots (a hybrid target with rollback=16) or its checkpoint (rollback=0,
    # and always on the draft side, whose drafts span several decodes), and its attention layers must drop
    # the positions past it too (seq_rm after a restore).
    target, draft = (tiny_qwen35, tiny_target) if side == "target" else (tiny_target, tiny_qwen35)
    with Engine(target, draft, ctx=256, threads=1, rollback_tokens=rollback) as e:
        for prompt in (PROMPT, "The quick brown fox"):
            toks = e.tokenize(prompt)
            base = e.session().generate(toks, GenerationSettings(n_predict=32), speculative=False).run()
            ses = e.session()
            g = ses.generate(toks, GenerationSettings(n_predict=32, draft_max=4)).run()
            assert len(set(base.tokens)) > 5 and g.tokens == base.tokens, prompt
            hybrid = ses.tgt if side == "target" else draft_memory(ses)
            if rollback and side == "target":
                assert hybrid.n_rollbacks > 0 and hybrid.n_restores == 0 and g.stats.n_rollbacks > 0
            else:
                assert hybrid.n_restores > 0 and hybrid.n_rollbacks == 0 and g.stats.n_restores >= hybrid.n_restores
            assert g.stats.n_drafted > 0
            assert_consistent(ses)
            before, again = list(ses.history), e.tokenize(" again")
            more = ses.generate(again, GenerationSettings(n_predict=16, draft_max=4)).run()  # on the same caches
            # (before a new session: sessions of one engine share its contexts)
            assert_memory_matches_a_fresh_evaluation(hybrid, target if side == "target" else draft)
            ref = e.session().generate(before + again, GenerationSettings(n_predict=16), speculative=False).run()
            assert more.tokens == ref.tokens


def test_a_hybrid_target_never_rolls_back_across_decodes(tiny_target, tiny_qwen35):
    # llama.cpp's snapshots cover only the last decode: a seq_rm further back reports success and leaves a wrong
    # state. A conversation that drops its last turn (history cut back by several steps) must restore instead.
    with Engine(tiny_qwen35, tiny_target, ctx=256, threads=1) as e:
        toks = e.tokenize(PROMPT)
        ses = e.session()
        ses.generate(toks, GenerationSettings(n_predict=24, draft_max=4)).run()
        del ses.history[len(toks) + 16:]  # forget 8 generated tokens: within n_rs_seq, but across decodes
        kept, again = list(ses.history), e.tokenize(" again")
        g = ses.generate(again, GenerationSettings(n_predict=16, draft_max=4)).run()
        ref = e.session().generate(kept + again, GenerationSettings(n_predict=16), speculative=False).run()
    assert g.tokens == ref.tokens


def assert_memory_matches_a_fresh_evaluation(cache, path):
    """The next-token logits from this cache equal a fresh evaluation of its tokens: after restores, both halves of
    a hybrid memory (recurrent state and attention KV) hold the committed positions and nothing else. On the
    draft side this is the only witness: a stale draft cache lowers acceptance but never changes the output."""
    toks = list(cache.tokens)
    cache.extend([7], logits="last")
    after = np.array(cache.ctx.logits(1)[0])
    with _ffi.Model(path) as m, _ffi.Context(m, 256, 1) as c:
        c.decode(toks + [7], 0, logits="last")
        ref = np.array(c.logits(1)[0])
    np.testing.assert_allclose(after, ref, rtol=1e-3, atol=1e-3)
