"""Several sequences decoded together (Engine(parallel=N), runtime/batch.py): each sequence's output is its own run
alone, its sampling law is the target's while others are decoded beside it, and the verify of several sequences
is one llama_decode."""

from __future__ import annotations

import numpy as np
import pytest

from beside import draft_memory
from specq.errors import UsageError
from specq.native.runtime.batch import Batch
from specq.native.runtime.config import kv_streams
from specq.native.runtime.engine import Engine
from specq.native.core.memory import common_prefix
from specq.native.core.settings import GenerationSettings
from specq.native.llama import ffi as _ffi
from stats import chi2_pvalue

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import numpy as np\n", "Once upon a time, there"]


def alone(target, prompts: list, lengths: list[int], ctx: int = 256, flash_attn: str = "auto") -> list[list[int]]:
    """Each prompt's (text or tokens) greedy answer from the target alone, one sequence, one token per step
    (`flash_attn`: the attention path; one sequence on the CPU runs the plain kernel under auto)."""
    with Engine(target, ctx=ctx, threads=1, flash_attn=flash_attn) as e:
        out = []
        for p, n in zip(prompts, lengths):
            ses = e.session()
            toks = e.tokenize(p) if isinstance(p, str) else p
            g = ses.generate(toks, GenerationSettings(n_predict=n), speculative=False).run()
            out.append(g.tokens)
        return out


def together(e: Engine, prompts: list[str], lengths: list[int], late: int = 0, **kw) -> list:
    """Generations on sequences 0.. stepped as one batch; the last `late` join after two steps."""
    batch = Batch()
    gens = [e.session(i).generate(e.tokenize(p), GenerationSettings(n_predict=n, **kw))
            for i, (p, n) in enumerate(zip(prompts, lengths))]
    for g in gens[:len(gens) - late]:
        batch.add(g)
    batch.step()
    batch.step()
    for g in gens[len(gens) - late:]:
        batch.add(g)
    batch.run()
    return gens


@pytest.mark.parametrize("unified", [True, False])
def test_a_waves_prompts_are_evaluated_in_one_decode_and_each_answer_is_its_own(unified, tiny_target, tiny_close,
                                                                                 monkeypatch):
    """One unified cache (a GPU's layout) joins a wave's prompts in one decode; a stream per sequence (the CPU's)
    evaluates them one by one. Either way a prompt that cannot start fails alone and the others are exact."""
    with Engine(tiny_target, ctx=64, threads=1) as e:
        toks = [e.tokenize(p) for p in (PROMPTS[0], PROMPTS[2], PROMPTS[3])]
    prompts, lengths = [t[:min(map(len, toks))] for t in toks], [20, 16, 24]
    want = alone(tiny_target, prompts, lengths)
    monkeypatch.setattr("specq.native.runtime.engine.kv_streams", lambda *a: not unified)
    with Engine(tiny_target, tiny_close, ctx=256, threads=1, parallel=4) as e:
        ctx = e.tgt_ctx
        assert ctx.unified == unified
        # auto on the CPU: flash attention where the sequences share one cache, the plain kernel with a stream each
        assert e.flash_attn == ("on" if unified else "off") and e.draft_flash_attn == "on"
        idle = e.session(1)  # between busy sequences: its memory kept
        idle.generate(e.tokenize(PROMPTS[1]), GenerationSettings(n_predict=3), speculative=False).run()
        held = list(idle.tgt.tokens)
        too_long = idle.generate(list(range(5, 305)), GenerationSettings(n_predict=4))
        del idle.history[:]
        multi0 = ctx.n_multi_decodes
        gens = [e.session(i).generate(p, GenerationSettings(n_predict=n, draft_max=3))
                for i, p, n in zip((0, 2, 3), prompts, lengths)]
        batch = Batch()
        failed = batch.add_all(gens[:1] + [too_long] + gens[1:])
        assert [g for g, _ in failed] == [too_long] and "does not fit" in str(failed[0][1])
        assert batch.n_joined_prompts == (3 if unified else 0) and ctx.n_multi_decodes == multi0 + unified
        assert idle.tgt.tokens == held and idle.tgt.ctx.pos_max() == len(held) - 1
        assert all(g.stats is None and g.snapshot().prompt_ms > 0 for g in gens)
        batch.run()
        for g, w in zip(gens, want):
            assert len(set(w)) > 5
            assert g.tokens == w
            assert g.stats.n_drafted > 0
            assert_consistent(g.session)


def assert_consistent(ses):
    """Each memory holds exactly its token list (on its own sequence), a prefix of the history."""
    for mem, committed in ((ses.tgt, ses.history[:-1]), (draft_memory(ses), ses.history)):
        if mem is not None:
            assert mem.ctx.pos_max() == len(mem.tokens) - 1, (mem.ctx.name, mem.ctx.seq)
            assert mem.tokens == committed[:len(mem.tokens)]


def test_each_sequence_greedy_equals_its_own_run_alone(tiny_target, tiny_close):
    lengths = [40, 12, 33, 25]
    want = alone(tiny_target, PROMPTS, lengths)
    with Engine(tiny_target, tiny_close, ctx=256, threads=1, parallel=4, flash_attn="on") as e:
        assert e.flash_attn == "on"  # exact with flash attention too (auto: off with a stream per sequence)
        gens = together(e, PROMPTS, lengths, late=1, draft_max=4)
        for g, w in zip(gens, want):
            assert len(set(w)) > 5
            assert g.tokens == w
            assert g.stats.n_drafted > 0 and 0 < g.stats.n_accepted < g.stats.n_drafted
            assert_consistent(g.session)
        # the verifies of several sequences were one llama_decode each, and so were their draft positions
        assert e.tgt_ctx.n_multi_decodes > 0 and e.tgt_ctx.max_seqs_per_decode == 4
        assert e.dft_ctx.n_multi_decodes > 0
        # a finished sequence takes a new prompt, keeping its cached prefix, while the others' memories stay
        ses = gens[1].session
        del ses.history[:]  # a new prompt replaces the history (as the server does)
        g = ses.generate(e.tokenize(PROMPTS[3]), GenerationSettings(n_predict=25, draft_max=4))
        batch = Batch()
        batch.add(g)
        batch.run()
        assert g.tokens == want[3]
        for other in gens:
            assert_consistent(other.session)


def test_a_draft_equal_to_the_target_accepts_everything_in_a_batch(tiny_target):
    with Engine(tiny_target, tiny_target, ctx=256, threads=1, parallel=3) as e:
        gens = together(e, PROMPTS[:3], [20, 20, 20], draft_max=5)
    for g in gens:
        assert g.stats.n_drafted > 0 and g.stats.n_accepted == g.stats.n_drafted


def test_ngram_and_a_model_drafter_mix_in_one_batch(tiny_target, tiny_close):
    base = "a b c d a b c d a b c"
    with Engine(tiny_target, ctx=256, threads=1) as e:  # a prompt that holds its own answer: n-gram matches
        said = e.session().generate(e.tokenize(base), GenerationSettings(n_predict=12), speculative=False).run()
    prompts = [base + said.text + base, PROMPTS[0]]
    want = alone(tiny_target, prompts, [30, 30])
    with Engine(tiny_target, tiny_close, ctx=256, threads=1, parallel=2) as e:
        gens = together(e, prompts, [30, 30], draft_max=4, drafter="ngram,model", ngram_min=1, ngram_max=2)
    assert [g.tokens for g in gens] == want
    assert dict(gens[0].stats.n_drafted_by).get("ngram", 0) > 0
    assert dict(gens[1].stats.n_drafted_by).get("model", 0) > 0


def test_a_hybrid_target_with_four_sequences_is_exact(tiny_qwen35, tiny_qwen35_close):
    lengths = [30, 18, 26, 22]
    want = alone(tiny_qwen35, PROMPTS, lengths)
    with Engine(tiny_qwen35, tiny_qwen35_close, ctx=256, threads=1, parallel=4) as e:
        gens = together(e, PROMPTS, lengths, draft_max=4)
        for g, w in zip(gens, want):
            assert len(set(w)) > 5
            assert g.tokens == w
            assert g.stats.n_drafted > g.stats.n_accepted > 0
            assert_consistent(g.session)
        assert sum(g.stats.n_rollbacks + g.stats.n_restores for g in gens) > 0  # rejected tails rolled back
        assert e.tgt_ctx.max_seqs_per_decode == 4
        assert e.tgt_ctx.unified  # a padding row would change an idle sequence's recurrent state (kv_streams)


def test_an_idle_sequence_too_full_for_the_padding_rows_gets_none(tiny_target):
    """A verify of r rows pads an idle sequence between busy ones with r rows after its last position; where its
    context has no room for them (an answer that filled it, left cached) the decode goes unpadded (split) instead of
    failing with a full context."""
    with Engine(tiny_target, ctx=64, threads=1, parallel=3) as e:
        ctx = e.tgt_ctx
        assert not ctx.unified
        full = ctx.n_ctx - 2  # two positions left: not enough for four rows
        for seq, n in ((0, 10), (1, full), (2, 10)):
            ctx.decode(list(range(5, 5 + n)), 0, logits="none", seq=seq)
        ctx.decode_seqs([(0, [7, 8, 9, 10], 10, "all"), (2, [7, 8, 9, 10], 10, "all")])
        assert ctx.n_padding_rows == 0 and ctx.pos_max(1) == full - 1
        ctx.seq_rm(10, -1, seq=0)
        ctx.seq_rm(10, -1, seq=2)
        ctx.seq_rm(full - 4, -1, seq=1)  # room for four rows: padded again
        ctx.decode_seqs([(0, [7, 8, 9, 10], 10, "all"), (2, [7, 8, 9, 10], 10, "all")])
        assert ctx.n_padding_rows == 4 and ctx.pos_max(1) == full - 5


def test_an_idle_sequence_between_busy_ones_gets_a_padding_row_and_keeps_its_memory(tiny_target, tiny_close):
    """On the CPU a plain target keeps a stream per sequence (config.kv_streams), and llama.cpp puts into one
    ubatch only sequences whose ids follow each other: sequences 0 and 2 stepping while 1 is idle decode a padding
    row for 1, removed after the decode. Outputs exact; sequence 1 holds what it held, and its next answer, which
    reuses its cached prefix, is exact too."""
    lengths = [30, 12, 26]
    want = alone(tiny_target, PROMPTS[:3], lengths, flash_attn="on")
    with Engine(tiny_target, tiny_close, ctx=256, threads=1, parallel=3) as e:
        assert not e.tgt_ctx.unified and e.dft_ctx.unified
        assert not (kv_streams(3, False, True) or kv_streams(3, True, False) or kv_streams(1, True, True))
        idle = e.session(1)
        g = idle.generate(e.tokenize(PROMPTS[1]), GenerationSettings(n_predict=lengths[1]), speculative=False).run()
        assert g.tokens == want[1]
        held = (list(idle.tgt.tokens), idle.tgt.ctx.pos_max())
        for speculative in (False, True):
            batch = Batch()
            gens = [e.session(i).generate(e.tokenize(PROMPTS[i]), GenerationSettings(n_predict=lengths[i],
                                                                                     draft_max=4), speculative)
                    for i in (0, 2)]
            for x in gens:
                batch.add(x)
            pads0 = e.tgt_ctx.n_padding_rows
            batch.run()
            assert [x.tokens for x in gens] == [want[0], want[2]]
            assert e.tgt_ctx.n_padding_rows > pads0  # the mechanism ran
            assert (list(idle.tgt.tokens), idle.tgt.ctx.pos_max()) == held
            assert_consistent(idle)
            for x in gens:
                assert_consistent(x.session)
                del x.session.history[:]
        assert gens[0].stats.n_drafted > 0
        sampled = GenerationSettings(n_predict=20, temp=0.8, seed=5)  # llama.cpp's sampler reads rows by batch index
        want_t = []
        for i in (0, 2):
            x = e.session(i).generate(e.tokenize(PROMPTS[i]), sampled, speculative=False).run()
            want_t.append(x.tokens)
            del x.session.history[:]
        pads0 = e.tgt_ctx.n_padding_rows
        gens = [e.session(i).generate(e.tokenize(PROMPTS[i]), sampled, speculative=False) for i in (0, 2)]
        batch = Batch()
        for x in gens:
            batch.add(x)
        batch.run()
        assert [x.tokens for x in gens] == want_t and len(set(want_t[0])) > 5 and e.tgt_ctx.n_padding_rows > pads0
        del idle.history[:]  # a new prompt sharing the old one's start: the cached prefix is reused
        prompt = e.tokenize(PROMPTS[1] + " jumps")
        assert common_prefix(idle.tgt.tokens, prompt) > 2
        g = idle.generate(prompt, GenerationSettings(n_predict=10), speculative=False).run()
        assert g.tokens == alone(tiny_target, [PROMPTS[1] + " jumps"], [10], flash_attn="on")[0]


def test_a_hybrid_sequence_rolls_back_only_within_its_own_last_decode(tiny_qwen35):
    """Recurrent-state snapshots cover a sequence's own last decode: another sequence's (here one at earlier
    positions) must not let a rollback reach further back."""
    want = alone(tiny_qwen35, [PROMPTS[1]], [10])[0]
    with Engine(tiny_qwen35, ctx=256, threads=1, parallel=2) as e:
        short, long_ = e.session(0), e.session(1)
        long_.generate(e.tokenize(PROMPTS[1]), GenerationSettings(n_predict=10), speculative=False).run()
        short.generate(e.tokenize("a"), GenerationSettings(n_predict=1), speculative=False).run()
        del long_.history[:]  # the same prompt again: back to its end, several decodes back
        g = long_.generate(e.tokenize(PROMPTS[1]), GenerationSettings(n_predict=10), speculative=False).run()
    assert g.tokens == want


def law_at(path, tokens: list[int], depth: int, temp: float, top_k: int) -> dict:
    """The target's law of its next `depth` tokens at a temperature, top-k, computed with numpy on its logits."""
    law = {}
    with _ffi.Model(path) as m, _ffi.Context(m, 128, 1) as c:
        def walk(prefix, prob, left):
            if left == 0:
                law[tuple(prefix[len(tokens):])] = prob
                return
            c.clear()
            c.decode(prefix, 0)
            z = np.array(c.logits(1)[0], np.float64) / temp
            z[np.argsort(z)[:-top_k]] = -np.inf
            p = np.exp(z - z.max())
            p /= p.sum()
            for t in np.flatnonzero(p > 0):
                walk(prefix + [int(t)], prob * float(p[t]), left - 1)
        walk(list(tokens), 1.0, depth)
    return law


def test_one_sequence_keeps_the_targets_law_while_others_decode_beside_it(tiny_target, tiny_close):
    """The first four tokens of sequence 0: the target's prefill's own, two drafted, and the verify's bonus token
    (where both were accepted)."""
    kw = dict(temp=0.8, top_k=3, top_p=1.0, min_p=0.0)
    with Engine(tiny_target, tiny_close, ctx=128, threads=1, parallel=3) as e:
        toks = e.tokenize(PROMPTS[0])
        law = law_at(tiny_target, toks, 4, 0.8, 3)
        sessions = [e.session(i) for i in range(3)]
        counts: dict = {}
        shared = drafted = bonus = 0
        for seed in range(2500):
            batch = Batch()
            for i, ses in enumerate(sessions):
                ses.reset()
                prompt = toks if i == 0 else e.tokenize(PROMPTS[i])
                batch.add(ses.generate(prompt, GenerationSettings(n_predict=4 + i, draft_max=2,
                                                                  seed=seed + 7919 * i, **kw)))
            g = batch.live[0]
            n0 = e.tgt_ctx.n_multi_decodes
            batch.run()
            shared += e.tgt_ctx.n_multi_decodes - n0 > 0
            drafted += g.stats.n_drafted
            bonus += g.stats.accepted_per_pos[1] > 0
            key = tuple(g.tokens[:4])
            counts[key] = counts.get(key, 0) + 1
    assert len(law) == 81
    assert shared == 2500 and drafted > 2500 and bonus > 300
    assert chi2_pvalue(counts, law) > 0.001


def test_parallel_refuses_a_bad_count(tiny_target):
    with pytest.raises(UsageError, match="--parallel"):
        Engine(tiny_target, ctx=128, threads=1, parallel=0)


def test_the_mtp_head_drafts_for_each_sequence_of_a_batch(mtp_target):
    """Each sequence's head has its own memory (its sequence id in the MTP context) fed by its own rows of the
    batched verifies (the trunk's hidden states routed by sequence): outputs equal to each one's run alone."""
    lengths = [30, 18, 26, 22]
    want = alone(mtp_target, PROMPTS, lengths)
    with Engine(mtp_target, None, ctx=256, threads=1, parallel=4, mtp=True) as e:
        gens = together(e, PROMPTS, lengths, late=1, draft_max=3, drafter="mtp")
        for g, w in zip(gens, want):
            assert len(set(w)) > 5
            assert g.tokens == w
            assert dict(g.stats.n_drafted_by)["mtp"] == g.stats.n_drafted > 0
            assert 0 < g.stats.n_accepted < g.stats.n_drafted
            head = g.session.drafters["mtp"]
            assert e.mtp_ctx.pos_max(head.seq) + 1 == len(head.tokens) <= len(g.session.history)
        assert e.tgt_ctx.n_multi_decodes > 0 and e.tgt_ctx.max_seqs_per_decode == 4


def test_each_sequence_has_its_own_context_of_ctx_tokens(tiny_target):
    with Engine(tiny_target, ctx=256, threads=1, parallel=2) as e:
        assert e.n_ctx == 256 and e.tgt_ctx.n_ctx == 256
        a, b = e.session(0), e.session(1)
        g = a.generate(e.tokenize(PROMPTS[0]), GenerationSettings(n_predict=300), speculative=False).run()
        assert g.stats.stop_reason == "ctx" and len(a.history) == 256
        g = b.generate(e.tokenize(PROMPTS[1]), GenerationSettings(n_predict=20), speculative=False).run()
        assert len(g.tokens) == 20 and g.stats.stop_reason == "n_predict"


def first_divergence_margin(target, prompt: list[int], got: list[int], want: list[int]) -> float | None:
    """Where two greedy answers to a prompt first differ, the target's gap between its top two logits there (one
    sequence, the shared prefix decoded in one batch); None where they agree."""
    i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if i is None:
        return None
    with _ffi.Model(target) as m, _ffi.Context(m, 1024, 2) as c:
        c.decode(prompt + want[:i], 0)
        top2 = np.sort(np.array(c.logits(1)[0]))[-2:]
    return float(top2[1] - top2[0])


@pytest.mark.slow
def test_demo_pair_four_sequences_each_as_alone():
    from specq.native.commands.demo import demo_pair

    target, draft = demo_pair()
    prompts = ["<|im_start|>user\nWrite a Python function that sorts a list.<|im_end|>\n<|im_start|>assistant\n",
               "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n",
               "The history of the Roman Empire", "def fibonacci(n):"]
    want = alone(target, prompts, [48] * 4, ctx=1024)
    with Engine(target, draft, ctx=1024, threads=2, parallel=4) as e:
        gens = together(e, prompts, [48] * 4, draft_max=8)
        toks = [e.tokenize(p) for p in prompts]
        assert e.tgt_ctx.max_seqs_per_decode == 4
    for g, w, t in zip(gens, want, toks):
        assert g.stats.n_drafted > 0 and g.stats.n_accepted > 0 and len(set(w)) > 5
        margin = first_divergence_margin(target, t, g.tokens, w)
        assert margin is None or margin < 0.5, (margin, g.text)  # INTERFACES.md: batched vs single kernels


def test_a_shared_prompt_start_is_copied_from_another_sequence_not_evaluated(tiny_target, tiny_close):
    system = "You are a careful assistant who answers in short sentences. " * 2
    # two sequences, a stream each, run the plain kernel on the CPU (config.choose_flash_attn), as the reference
    # does, so that a difference is the copied prefix's, not the kernels' rounding at a near tie
    want = alone(tiny_target, [system + PROMPTS[1]], [20])[0]
    with Engine(tiny_target, tiny_close, ctx=512, threads=1, parallel=2) as e:
        assert e.flash_attn == "off" and not e.tgt_ctx.unified
        a, b = e.session(0), e.session(1)
        a.generate(e.tokenize(system + PROMPTS[0]), GenerationSettings(n_predict=8, draft_max=4)).run()
        prompt = e.tokenize(system + PROMPTS[1])
        n = b.share_prefix(a, prompt, least=32)
        shared = len(e.tokenize(system)) - 1
        assert n >= shared and b.tgt.tokens == prompt[:n] and draft_memory(b).tokens == prompt[:len(draft_memory(b).tokens)]
        assert len(draft_memory(b).tokens) >= shared
        # the memories hold the copied cells (nothing was decoded on sequence 1)
        assert b.tgt.ctx.pos_max() == n - 1 and draft_memory(b).ctx.pos_max() == len(draft_memory(b).tokens) - 1
        g = b.generate(prompt, GenerationSettings(n_predict=20, draft_max=4)).run()
        assert g.tokens == want and g.stats.n_drafted > 0
        assert_consistent(a)
        assert_consistent(b)
        assert b.share_prefix(a, prompt, least=32) == 0  # nothing more to gain


def test_a_deferred_prompt_read_keeps_out_of_a_joiners_first_step(tiny_target, tiny_close):
    """A lone request's draft whose prompt read waited while another request joined (Batch.delivered(defer)):
    the step that gives the joiner its first token drafts nothing for it (its catch-up would hold that token
    back); it catches up and drafts at a later step, and both answers are their own."""
    lengths = [24, 20]
    want = alone(tiny_target, PROMPTS[:2], lengths)
    with Engine(tiny_target, tiny_close, ctx=256, threads=1, parallel=2) as e:
        batch = Batch()
        a, b = (e.session(i).generate(e.tokenize(p), GenerationSettings(n_predict=n, draft_max=4))
                for i, (p, n) in enumerate(zip(PROMPTS, lengths)))
        batch.add(a)
        batch.step(read_now=False)  # a's first token
        batch.delivered(defer=True)
        assert batch.n_deferred_reads == 1 and a.session.drafters["model"].behind() > 2
        batch.add(b)
        batch.step()  # b's first token: a steps plain beside it
        assert batch.n_first_plain == 1 and a.snapshot().n_drafted == 0
        batch.run()
    assert a.tokens == want[0] and b.tokens == want[1] and a.stats.n_drafted > 0 and b.stats.n_drafted > 0
