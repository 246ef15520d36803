"""The target's own multi-token-prediction (NextN/MTP) head as a drafter (llama.cpp's MTP context type).

The head's position k is fed the token t_k and the trunk's last hidden state h_{k-1} (normed, the row that
predicted t_k); its output at k predicts t_{k+1}. Its KV cache holds positions 0..m-1 paired that way with
committed tokens only. Drafting a step after history t_0..t_{n-1}: one decode of the entries still missing up to
(t_{n-1}, h_{n-2}) gives d1; each further position takes the drafted token and the head's own output hidden state
(no trunk state exists for an unverified token), and is removed once the step has drafted. The trunk's rows come
from every target decode (`on_hidden`); they are kept only until the head has consumed them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...errors import ModelFileError, UsageError
from ..core.memory import common_prefix
from ..core.sampling import Sampling
from ..llama import ffi as _ffi
from .base import CATCHUP_SHORT, Drafter, Proposal, pick, pick_loop, proposal_with_costs

if TYPE_CHECKING:
    from ..runtime.engine import Engine
    from ..runtime.session import Session
    from ..core.settings import GenerationSettings

FLUSH_ROWS = 256  # rows kept before the head catches up on committed positions (bounds memory on long prompts)


def no_head_error(target) -> ModelFileError:
    """The error for a target without MTP layers asked to draft with them."""
    return ModelFileError(f"the target has no MTP layers ({target.path}); use --drafter model or ngram, or a target "
                          "converted with its MTP head")


class HiddenRows:
    """The trunk's hidden states of consecutive positions p0.. (a later decode at a position replaces it and
    everything after it: those rows belonged to tokens that are no longer there)."""

    def __init__(self, n_embd: int):
        self.p0 = 0
        self.rows = np.zeros((0, n_embd), np.float32)

    @property
    def end(self) -> int:
        return self.p0 + len(self.rows)

    def put(self, pos: int, rows: np.ndarray) -> None:
        if pos < self.p0 or pos > self.end:  # a re-decode before the kept rows, or a gap: start again at pos
            self.p0, keep = pos, self.rows[:0]
        else:
            keep = self.rows[:pos - self.p0]
        self.rows = np.concatenate([keep, rows]).astype(np.float32, copy=False)

    def has(self, a: int, b: int) -> bool:
        """Whether rows for positions a..b-1 are all held."""
        return b <= a or (self.p0 <= a and b <= self.end)

    def take(self, a: int, b: int) -> np.ndarray:
        return self.rows[a - self.p0:b - self.p0]

    def drop_before(self, p: int) -> None:
        if p > self.p0:
            cut = min(p, self.end)
            self.rows = self.rows[cut - self.p0:]
            self.p0 = cut


class MtpDrafter(Drafter):
    """--drafter mtp: one session's use of the engine's MTP context: the head's cache of committed positions and
    the trunk rows it still needs. `history` is the session's committed token list (read, never changed here)."""

    name = "mtp"

    def __init__(self, session: Session):
        super().__init__(session)
        self.ctx = self.shared
        self.seq = session.seq  # the head's memory for this session: the same sequence id as the target's
        self.history = session.history
        self.tokens: list[int] = []  # t_0..t_{m-1}: what the head's memory holds, each paired with h_{k-1}
        self.rows = HiddenRows(self.ctx.n_embd)
        self.n_redecodes = 0  # target re-decodes forced by missing trunk rows (after a rollback)

    @classmethod
    def provide(cls, engine: Engine) -> _ffi.MtpContext | None:
        """The head's context (engine.mtp_ctx), where the engine loaded the target's head (Engine(mtp=...)): as
        long as the target's, a sequence per --parallel."""
        if engine.config.mtp is False or engine.target.n_layer_nextn < 1:
            return None
        return _ffi.MtpContext(engine.target, engine.config.ctx, engine.threads, n_batch=engine.config.n_batch,
                               n_seq=engine.parallel)

    @classmethod
    def available(cls, engine: Engine) -> bool:
        return engine.mtp_ctx is not None

    @classmethod
    def check(cls, engine: Engine) -> None:
        if engine.mtp_ctx is None:
            if engine.target.n_layer_nextn < 1:
                raise no_head_error(engine.target)
            raise UsageError("--drafter mtp needs the engine loaded with its MTP head (Engine(..., mtp=True))")

    @classmethod
    def cost_prior(cls, engine: Engine) -> float:
        """One decoder layer of the target's, and its output head."""
        return min(1.0, 2.0 / max(engine.target.n_layer, 1))

    @classmethod
    def engine_options(cls, drafters: tuple[str, ...]) -> dict:
        """Engine(mtp=...): required for mtp, where present for auto, else not loaded."""
        return {"mtp": True if cls.name in drafters else (None if drafters == ("auto",) else False)}

    def attach(self, on: bool) -> None:
        """Route the target's hidden states to this drafter (the engine's contexts are shared), or stop them where
        no step can draft with it (the target alone pays nothing for the head). Rows missed meanwhile are
        evaluated again when the head next drafts (missing_from)."""
        tgt_ctx = self.session.engine.tgt_ctx
        want = self.on_hidden if on else None
        if tgt_ctx.hidden_sink(self.seq) != want:
            tgt_ctx.output_hidden(want, self.seq)

    def propose(self, n_max: int, s: GenerationSettings, samp: Sampling) -> Proposal:
        """Draft with the target's MTP head, as a draft model does (the same picking, the same timings)."""
        ses = self.session
        clock = ses.engine.clock
        a = self.missing_from()
        if a is not None:  # the trunk rows from there were dropped (a rollback): the target evaluates them again
            ses.tgt.truncate(a)
            ses.tgt.extend(self.history[len(ses.tgt.tokens):-1], logits="none")
            self.n_redecodes += 1
        t_catchup, catchup = clock(), len(self.history) - len(self.tokens)
        if catchup > CATCHUP_SHORT:  # a long catch-up (after plain steps) is prefill-like:
            self.catch_up(len(self.history) - 1)  # decoded apart, so the first token's cost stays clean
        t_first = clock()
        self.begin()
        t_loop = clock()
        try:
            n_vocab = ses.engine.target.n_vocab
            drafts, dists = pick_loop(
                lambda d: pick(samp.draft_row(self.ctx.logits(), d), s.p_min, samp, n_vocab, clock),
                self.advance, n_max, ses.until)
        finally:
            self.end()
        return proposal_with_costs(drafts, dists, catchup, t_catchup, t_first, t_loop, clock())

    def rewind(self) -> None:
        self.truncate(common_prefix(self.tokens, self.history))

    def clear(self) -> None:
        self.tokens.clear()
        self.ctx.clear(self.seq)
        self.rows = HiddenRows(self.ctx.n_embd)

    def on_hidden(self, pos0: int, rows: np.ndarray) -> None:
        """The target decoded positions pos0..; keep their rows, and let the head catch up on committed positions
        when many are waiting (a long prompt)."""
        self.rows.put(pos0, rows)
        if len(self.rows.rows) > FLUSH_ROWS:
            upto = min(self.rows.end, len(self.history))
            if upto > len(self.tokens) and self.rows.has(max(len(self.tokens) - 1, 0), upto - 1):
                self._extend(upto, logits=False)

    def _pairs(self, upto: int) -> tuple[list[int], np.ndarray]:
        """The tokens and trunk rows of head positions m..upto-1: token t_k with h_{k-1} (zeros before t_0)."""
        m = len(self.tokens)
        toks = self.history[m:upto]
        if m == 0:
            rows = np.concatenate([np.zeros((1, self.ctx.n_embd), np.float32), self.rows.take(0, upto - 1)])
        else:
            rows = self.rows.take(m - 1, upto - 1)
        return toks, rows

    def _extend(self, upto: int, logits: bool) -> None:
        toks, rows = self._pairs(upto)
        m = len(self.tokens)
        self.tokens.extend(toks)  # recorded first: an interruption leaves the list ahead of the memory
        self.ctx.decode(toks, m, rows, logits_last=logits, seq=self.seq)
        self.rows.drop_before(upto - 1)  # h_{upto-1} pairs with the next committed token

    def truncate(self, n: int) -> None:
        """Make the head's memory hold exactly tokens[:n] (the memory is the source of truth, as in Memory)."""
        held = self.ctx.pos_max(self.seq) + 1
        if held < len(self.tokens):
            del self.tokens[held:]
        n = min(n, len(self.tokens))
        if held > n:
            self.ctx.seq_rm(n, -1, self.seq)
            del self.tokens[n:]

    def missing_from(self) -> int | None:
        """Before a draft: the first target position whose trunk row the head needs and no longer has (rows are
        dropped once consumed, so this happens only after the history was rolled back); None: all there."""
        n = len(self.history)
        if len(self.tokens) >= n:  # t_{n-1}'s output is needed again: decode that position once more
            self.truncate(n - 1)
        a = max(len(self.tokens) - 1, 0)
        return None if self.rows.has(a, n - 1) else a

    def catch_up(self, upto: int) -> None:
        """Decode the committed positions still missing below `upto`, without output."""
        if upto > len(self.tokens):
            self._extend(upto, logits=False)

    def begin(self) -> None:
        """Decode the positions still missing up to (t_{n-1}, h_{n-2}); its output proposes d1."""
        self._extend(len(self.history), logits=True)

    def advance(self, token: int, i: int) -> None:
        """Feed drafted token d_i (i from 1) at its position with the head's own output state: no trunk state
        exists for an unverified token."""
        h = self.ctx.hidden()
        self.ctx.decode([token], len(self.history) - 1 + i, h[None, :], logits_last=True, seq=self.seq)

    def end(self) -> None:
        """Remove the drafted positions (they carry the head's own state; the verify brings the trunk's)."""
        self.truncate(len(self.history))
