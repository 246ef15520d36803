"""One conversation: the token history, the target's memory, its drafters, prefill and rollback (the speculative
step is runtime/step.py's, for one sequence or several)."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, TYPE_CHECKING

from ...errors import ContextFullError, UsageError
from ..core.memory import Memory, common_prefix
from ..core.prompt import AgreeRows, Span
from ..core.settings import AGREE_MIN, GenerationSettings
from ..drafters import registry
from ..drafters.base import Agreement, Drafter, Timing
from .generation import Generation, new_controller

if TYPE_CHECKING:
    from ..control.chooser import DrafterChooser
    from ..control.length import LengthController
    from .engine import Engine


class Session:
    """One conversation: the token history, the target's memory and the drafters' (`drafters`, by name), kept
    consistent across generations."""

    def __init__(self, engine: Engine, seq: int = 0):
        self.engine = engine
        self.seq = seq  # its sequence in both models' memories (Engine(parallel=N): 0..N-1)
        one = engine.parallel == 1
        self.tgt_ctx = engine.tgt_ctx if one else engine.tgt_ctx.seq(seq)
        self.history: list[int] = []  # changed in place only: drafters read the same list
        self._controllers: dict[tuple, LengthController | DrafterChooser] = {}
        self.tgt = Memory(self.tgt_ctx, partial_rm=not engine.target.is_recurrent_or_hybrid)
        self.drafters: dict[str, Drafter] = registry.build(self)
        # the drafter with a memory of the prompt (a draft model), which prefill fills, times and compares
        self.reader = next((d for d in self.drafters.values() if d.reads_prompt), None)
        self.agreement: Agreement | None = None  # the last prefill's (see prefill's agree)
        # the last prefill's longest read of the prompt by the reader: (context, tokens, seconds), a catch-up's cost
        self.read_timing: tuple[int, int, float] | None = None
        self._pending = None  # prefill_target's work for prefill_reader
        # a folded prefill (prefill_target): the target also holds the history's last token, its logits the last
        # output of the context's decode number _ahead (Context.n_decode_calls); the first step takes them (take_ahead)
        self._ahead: int | None = None
        self.n_folded = 0  # first tokens taken from their prefill's decode (take_ahead)
        # this step's stop rule for a drafter drafting token by token (None: none): it stops once it holds for the
        # drafts so far (--drafter auto hands the step over to an n-gram match: generation.handover_rule)
        self.until: Callable[[list[int]], bool] | None = None
        self.reset()

    def reset(self) -> None:
        self._pending = None
        self._ahead = None
        self.history.clear()
        self.tgt.clear()
        for d in self.drafters.values():
            d.clear()

    def attach(self, s: GenerationSettings, speculative: bool) -> None:
        """Tell each drafter whether the coming generation may draft with it."""
        for name, d in self.drafters.items():
            d.attach(speculative and (name in s.drafters or s.drafters == (registry.AUTO,)))

    def available_drafters(self, s: GenerationSettings) -> tuple[str, ...]:
        """The drafters a step may use: --drafter's list, or for auto every one this engine can run."""
        return tuple(self.drafters) if s.drafters == (registry.AUTO,) else s.drafters

    @property
    def n_ctx(self) -> int:
        return self.engine.n_ctx

    @property
    def decode_s(self) -> float:
        """Time inside llama_decode so far on this session's own contexts (not the engine's)."""
        return sum(d.decode_s for d in self.drafters.values())

    @property
    def n_restores(self) -> int:
        """Checkpoint restores so far, every memory (memories that cannot drop part of a sequence)."""
        return self.tgt.n_restores + sum(d.n_restores for d in self.drafters.values())

    @property
    def n_rollbacks(self) -> int:
        """Recurrent/hybrid tails dropped through state snapshots so far, every memory."""
        return self.tgt.n_rollbacks + sum(d.n_rollbacks for d in self.drafters.values())

    def controller(self, s: GenerationSettings) -> LengthController | DrafterChooser:
        """The draft_max="auto" controller for these sampling settings. It lives as long as the session
        (reset() included): costs and acceptance belong to the pair and the machine, not to one prompt, so
        later generations start from what earlier ones measured instead of from a prior."""
        key = (s.draft_cap, s.accept_mode, s.temp, s.top_k, s.top_p, s.min_p, s.p_min, s.drafters)
        if key not in self._controllers:
            self._controllers[key] = new_controller(self, s)
        return self._controllers[key]

    def auto_limits(self, s: GenerationSettings, n_draft_max: int) -> dict[str, int]:
        """--drafter auto: the most each available drafter could draft this step."""
        return {name: self.drafters[name].limit(n_draft_max, s) for name in self.available_drafters(s)}

    def auto_keys(self, s: GenerationSettings, n_draft_max: int) -> dict[str, str | None]:
        """--drafter auto: what kind of proposal each available drafter has now (Drafter.evidence)."""
        return {name: self.drafters[name].evidence(n_draft_max, s) for name in self.available_drafters(s)}

    def rewind(self) -> None:
        """Roll every memory back to the committed history (the target holds all but the last token)."""
        self.tgt.truncate(common_prefix(self.tgt.tokens, self.history[:-1]))
        for d in self.drafters.values():
            d.rewind()

    def share_prefix(self, other: Session, prompt: list[int], least: int = 1) -> int:
        """Take over, from another sequence's memories, the start of `prompt` they hold and this one does not (a
        shared system prompt): copied, not evaluated again (Memory.copy_prefix). Returns the target tokens
        taken over (0: none; also where it would gain fewer than `least` tokens). Before a prefill of `prompt`, on
        an empty history."""
        n = common_prefix(other.tgt.tokens, prompt[:-1])
        if self.engine.parallel == 1 or self.history or n < common_prefix(self.tgt.tokens, prompt[:-1]) + least:
            return 0
        got = self.tgt.copy_prefix(other.tgt, n)
        if got:
            for name, d in self.drafters.items():
                if name in other.drafters:
                    d.share_prefix(other.drafters[name], got, prompt)
        return got

    def rollback(self, n: int) -> None:
        """Keep the first n tokens of the history and roll every memory back to them (a server's stop string
        that ends inside a multi-token step)."""
        if not 0 < n <= len(self.history):
            raise ValueError(f"cannot roll back to {n} tokens of a {len(self.history)}-token history")
        del self.history[n:]
        self.rewind()

    # ==== prefill ===============================================================================
    def prefill(self, new_tokens: list[int], spans_to_time: Callable[[int, int], list[tuple[int, int]]] | None = None,
                agree: int = 0, sampled: GenerationSettings | None = None) -> list[Timing]:
        """Append tokens to the history and evaluate all but the last on the target and the reader: the target's
        part (prefill_target), then the reader's (prefill_reader).

        `spans_to_time(first, last)`: spans (position, n_tokens) among the new ones (first..last-1 may be evaluated) to
        decode alone and time (a Timing each). `agree`: up to that many new tokens just before the timed spans
        are decoded with every row's logits on the target and the reader, and `self.agreement` is set (None
        where none were compared): greedy choices that agree, or with `sampled` (rejection sampling's settings)
        each row's expected acceptance Σ min(p, q) under their transform, summed. The tokens and positions
        decoded are the same either way."""
        self.prefill_target(new_tokens, spans_to_time, agree, sampled)
        return self.prefill_reader()

    def prefill_target(self, new_tokens: list[int], spans_to_time: Callable[[int, int], list[tuple[int, int]]] | None = None,
                       agree: int = 0, sampled: GenerationSettings | None = None,
                       joined: list | None = None, fold: bool = True) -> None:
        """prefill's target part: the target holds all but the history's last token when it returns (with `fold`
        where _folds: that one too, its logits for the first step: take_ahead), and a
        generation can take its first token (a plain step) before the reader reads the prompt
        (prefill_reader), so that the draft's side of the prefill stays off the path to the first token.
        `joined`: the tokens after the timed spans are not decoded but appended to it as (memory, tokens, "none"),
        for one decode with other sequences' prompts (memory.extend_many; runtime/batch.py)."""
        if not new_tokens:
            raise UsageError("empty prompt; give some text to start from")
        total = len(self.history) + len(new_tokens)
        if total + 1 > self.n_ctx:
            raise ContextFullError(
                f"prompt does not fit in the context ({total} tokens, ctx {self.n_ctx}); "
                "use a larger --ctx or a shorter prompt")
        self.history.extend(new_tokens)
        self.agreement = None
        self._pending = self._ahead = None
        try:
            self.rewind()
            fold = fold and joined is None and self._folds()
            self._pending = self._target_spans(self._spans(spans_to_time, agree), sampled, joined, fold)
            if fold:
                self._ahead = self.tgt.ctx.n_decode_calls
        except BaseException:
            del self.history[-len(new_tokens):]
            self.rewind()
            raise

    def prefill_reader(self) -> list[Timing]:
        """prefill's reader part, after prefill_target (and maybe a first token): the reader reads the prompt,
        times its spans' tokens and compares its greedy choices with the target's on the agreement span
        (Drafter.read_prompt; `agreement` and `read_timing` set). The Timings of the timed spans (draft_s None
        where the reader timed none)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return []
        if self.reader is None:
            return [Timing(span.pos, span.n, got, None) for span, got in pending if not span.agree]
        read = self.reader.read_prompt(pending, len(self.history) - 1)  # all but the last token, as the target
        self.read_timing = read.longest
        if read.agreement is not None:
            self.agreement = read.agreement
        return read.timings

    def _folds(self) -> bool:
        """Whether a prefill evaluates the prompt's last token too (folded): where the first step can take its
        logits from the prefill's decode instead of a decode of its own (one pass less before the first token, as
        llama.cpp's own loops take it), and where one token can be dropped again (not hybrid, sliding-window or
        MTP targets)."""
        return self.tgt.partial_rm and not self.tgt.ctx.n_swa and self.engine.mtp_ctx is None

    def take_ahead(self, use: bool) -> bool:
        """Whether the target holds the history's last token with its logits still the context's last output (a
        folded prefill, no decode since): then, where `use` (a step of this sequence alone and plain), the step
        reads them and decodes nothing; otherwise the token is dropped for the step to decode again. Once only."""
        stamp, self._ahead = self._ahead, None
        if stamp is None:
            return False
        if use and stamp == self.tgt.ctx.n_decode_calls and len(self.tgt.tokens) == len(self.history):
            self.n_folded += 1
            return True
        self.tgt.truncate(len(self.history) - 1)
        return False

    def drop_reader_prefill(self) -> None:
        """The reader will not read the prompt now (prefill_reader skipped): it catches up when it drafts."""
        self._pending = None

    def _spans(self, spans_to_time: Callable[[int, int], list[tuple[int, int]]] | None, agree: int) -> list[Span]:
        """The timed spans in order, not overlapping, and the agreement span just before those that end the
        prompt (and after any earlier one)."""
        last = len(self.history) - 1
        spans, end = [], len(self.tgt.tokens)
        for pos, n in sorted(set(spans_to_time(len(self.tgt.tokens), last) if spans_to_time else ())):
            if pos >= end and n >= 1 and pos + n <= last:
                spans.append(Span(pos, n))
                end = pos + n
        if agree > 0 and self.reader is not None:
            i, stop = len(spans), last
            while i > 0 and spans[i - 1].pos + spans[i - 1].n == stop:
                i -= 1
                stop = spans[i].pos
            start = max(spans[i - 1].pos + spans[i - 1].n if i else len(self.tgt.tokens), stop - agree)
            if stop - start >= AGREE_MIN:
                spans.insert(i, Span(start, stop - start, agree=True))
        return spans

    def _target_spans(self, spans: list[Span], sampled: GenerationSettings | None,
                      joined: list | None = None, fold: bool = False) -> list[tuple[Span, object]]:
        """Decode the prompt on the target, each span alone: a timed span's seconds, an agreement span's greedy
        choices (every row's logits) and, with `sampled`, its rows under that transform (AgreeRows), for the
        reader's part. The rest in one decode: up to the last token, or with `fold` that too, its logits kept."""
        hist, clock, done = self.history, self.engine.clock, []
        for span in spans:
            pos, n = span.pos, span.n
            self.tgt.extend(hist[len(self.tgt.tokens):pos], logits="none")
            t0 = clock()
            self.tgt.extend(hist[pos:pos + n], logits="all" if span.agree or n > 1 else "last")
            t1 = clock()
            done.append((span, AgreeRows.of(self.tgt.ctx.logits(n), sampled) if span.agree else t1 - t0))
        if fold:  # the last token too, with its logits: the first token's (take_ahead)
            self.tgt.extend(hist[len(self.tgt.tokens):], logits="last")
        elif joined is None:
            self.tgt.extend(hist[len(self.tgt.tokens):len(hist) - 1], logits="none")
        else:
            rest = hist[len(self.tgt.tokens):len(hist) - 1]
            joined.append((self.tgt, rest, "none"))
        return done

    def generate(self, new_tokens: list[int], settings: GenerationSettings, speculative: bool = True) -> Generation:
        """A generation of `new_tokens` after the history; its settings' drafters checked against the registry
        and this engine, and listed in the order each step tries them."""
        settings = settings.validate()
        ordered = ",".join(registry.parse_drafter(settings.drafter))
        if ordered != settings.drafter:
            settings = replace(settings, drafter=ordered)
        if speculative:
            registry.check(self.engine, settings.drafters)
        return Generation(self, new_tokens, settings, speculative)
