"""The first token comes from the target's prefill alone: the draft's side of the prefill (reading the prompt,
timing, the agreement with the target, a window trial) waits until it is out, and drafting starts right after."""

from __future__ import annotations

import pytest

from beside import draft_memory
from specq.native.runtime.batch import Batch
from specq.native.runtime import step as speculative
from specq.native.runtime.engine import Engine, SimulatedClock
from specq.native.core.settings import GenerationSettings

PROMPT = "def fibonacci(n):"
LONG = "The quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire. " * 2 + PROMPT


@pytest.mark.parametrize("draft_max", [4, "auto"])
def test_no_draft_decode_comes_before_the_first_token(tiny_target, tiny_close, draft_max):
    # the simulated clock prices the draft at a tenth of the target, so that auto drafts whatever the load
    clock = SimulatedClock(lambda name, n, pos0: (0.001 if name == "draft" else 0.010 + 0.001 * n))
    with Engine(tiny_target, tiny_close, ctx=256, threads=1, clock=clock) as e:
        toks = e.tokenize(LONG)  # long enough for a prompt agreement (auto)
        base = e.session().generate(toks, GenerationSettings(n_predict=40), speculative=False).run()
        ses = e.session()
        d0, t0 = e.dft_ctx.n_decode_calls, e.tgt_ctx.n_decode_calls
        g = ses.generate(toks, GenerationSettings(n_predict=40, draft_max=draft_max))
        events = iter(g)
        first = next(events)
        # the target decoded the prompt and sampled; the draft has not decoded anything yet
        assert e.tgt_ctx.n_decode_calls > t0 and e.dft_ctx.n_decode_calls == d0
        rest = list(events)
        tokens = [first.token] + [ev.token for ev in rest]
    assert len(set(base.tokens)) > 5 and tokens == g.tokens == base.tokens
    assert e.dft_ctx.n_decode_calls > d0 and g.stats.n_drafted > 0  # the draft read the prompt and drafted after
    if draft_max == "auto":
        assert ses.agreement is not None  # the prompt agreement still ran, after the first token


def test_the_reader_reads_the_whole_prompt_before_the_first_speculative_step(tiny_target, tiny_close):
    """The first drafting step catches up on one token only (the first token): a clean first-token timing."""
    with Engine(tiny_target, tiny_close, ctx=256, threads=1) as e:
        toks = e.tokenize(PROMPT)
        ses = e.session()
        seen = []
        real = speculative.step

        def spy(asks):
            if asks[0].n_draft_max > 0 and not seen:
                seen.append(len(ses.history) - draft_memory(ses).next_index())
            return real(asks)

        speculative.step = spy
        try:
            g = ses.generate(toks, GenerationSettings(n_predict=16, draft_max=4)).run()
        finally:
            speculative.step = real
    assert seen == [1] and g.stats.n_drafted > 0


def test_a_first_token_alone_is_read_from_the_prefills_own_decode(tiny_target):
    """The prompt's last token is evaluated with the prompt (a folded prefill): the first token takes no decode of
    its own, as in llama.cpp's loops, and is the target's greedy choice after the prompt (the reference: llama.cpp's
    context driven directly, the prompt and then its last token alone, as the engine did before the fold)."""
    with Engine(tiny_target, ctx=256, threads=1) as e:
        toks = e.tokenize(LONG)
        ctx = e.tgt_ctx
        ctx.decode(toks[:-1], 0, logits="none")
        ctx.decode(toks[-1:], len(toks) - 1, logits="last")
        want = int(ctx.logits(1)[0].argmax())
        ctx.clear()
        ses = e.session()
        n0 = ctx.n_decode_calls
        g = ses.generate(toks, GenerationSettings(n_predict=1), speculative=False).run()
        assert ctx.n_decode_calls - n0 == 1 and ses.n_folded == 1  # the prompt's decode, nothing for the token
        assert g.tokens == [want]
        # llama.cpp's sampler (match acceptance) reads the prefill's last row by its index in the batch
        ses = e.session()
        sampled = ses.generate(toks, GenerationSettings(n_predict=1, temp=0.8, seed=3, accept="match", draft_max=4,
                                                           drafter="ngram"))
        assert sampled.run().stats.accept_mode == "match" and len(sampled.tokens) == 1 and ses.n_folded == 1


def test_a_decode_between_the_prefill_and_the_first_step_drops_the_folded_row(tiny_target):
    """A sequence that steps alone after another sequence's prompt was decoded in the same context (that request
    cancelled before its first step) cannot read its row from the prefill any more: it decodes its last token again
    and its answer is its own (with the stale row it would be the other prompt's)."""
    a, b = "def fibonacci(n):", "Once upon a time, there"
    with Engine(tiny_target, ctx=256, threads=1) as e:
        want = e.session().generate(e.tokenize(a), GenerationSettings(n_predict=12), speculative=False).run().tokens
        other = e.session().generate(e.tokenize(b), GenerationSettings(n_predict=1), speculative=False).run().tokens
    assert want[0] != other[0] and len(set(want)) > 3
    with Engine(tiny_target, ctx=256, threads=1, parallel=2) as e:
        batch = Batch()
        sa = e.session(0)
        ga = sa.generate(e.tokenize(a), GenerationSettings(n_predict=12), speculative=False)
        gb = e.session(1).generate(e.tokenize(b), GenerationSettings(n_predict=12), speculative=False)
        batch.add(ga)
        batch.add(gb)
        batch.cancel(gb)
        n0 = e.tgt_ctx.n_decode_calls
        batch.run()
        assert e.tgt_ctx.n_decode_calls - n0 == 12 and sa.n_folded == 0
    assert ga.tokens == want
