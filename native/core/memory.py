"""One model's memory: the tokens its llama.cpp context holds, and the one way to roll it back."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..llama import ffi as _ffi


@dataclass
class Memory:
    """One model's context and exactly the tokens its memory holds (positions 0..len-1)."""

    ctx: _ffi.Context
    tokens: list[int] = field(default_factory=list)  # history[:sink] + history[offset:], at positions 0..
    offset: int = 0  # a draft's window: where in the history the recent tokens it holds begin
    sink: int = 0  # a window also keeps the history's first tokens (attention sinks), this many
    checkpoint: tuple[int, bytes] | None = None  # (n_tokens, state) for memories without partial removal
    partial_rm: bool = True
    n_restores: int = 0  # checkpoint restores; on a sliding-window memory, re-evaluations (cells gone)
    n_rollbacks: int = 0  # tails removed through n_rs_seq snapshots, or from a sliding window that has slid

    def _can_roll_back(self, n: int, held: int) -> bool:
        """Whether seq_rm may drop positions n.. of a recurrent memory: the snapshots cover only the tail of the
        last decode, at most n_rs_seq tokens (past that llama.cpp's seq_rm may report success and be wrong)."""
        return 0 < held - n <= self.ctx.n_rs_seq and n >= self.ctx.last_decode_pos0

    def truncate(self, n: int) -> None:
        """Make the memory hold exactly tokens[:n], whatever an interrupted call left in it.

        The memory is the source of truth: `extend` records tokens before decoding them, so after an
        exception anywhere the list may claim more than the memory holds (never the reverse), and
        positions past the list are removed whatever the list says."""
        held = self.ctx.pos_max() + 1
        if held < len(self.tokens):  # a decode that did not complete: its tokens are not in the memory
            del self.tokens[held:]
        n = min(n, len(self.tokens))
        if held <= n:
            return
        if self.partial_rm and not self.ctx.window_intact(n):
            # A sliding-window cache already reused the cells that position n attends to: evaluate again.
            keep = self.tokens[:n]
            self.ctx.clear()  # (the draft window's offset stays: the same tokens at the same positions)
            self.tokens.clear()
            self.n_restores += 1
            self.extend(keep, logits="none")
            return
        if self.partial_rm and self.ctx.seq_rm(n, -1):
            del self.tokens[n:]
            if self.ctx.n_swa and self.ctx.pos_min() > 0:  # the window had slid: count what relied on it
                self.n_rollbacks += 1
            return
        if not self.partial_rm and self._can_roll_back(n, held) and self.ctx.seq_rm(n, -1):
            del self.tokens[n:]
            self.n_rollbacks += 1
            return
        # Recurrent/hybrid memory: go back to the checkpoint, then re-evaluate up to n.
        keep = self.tokens[:n]
        if self.checkpoint is None or self.checkpoint[0] > n:
            self.ctx.clear()
            base = 0
        else:
            base, state = self.checkpoint
            self.ctx.state_set(state)
            self.ctx.seq_rm(base, -1)  # hybrid: the attention part still holds the later positions
            self.n_restores += 1
        del self.tokens[base:]
        self.extend(keep[base:], logits="none")

    def save_checkpoint(self, n_next: int | None = None) -> None:
        """Save the state before decoding `n_next` more tokens (None: several decodes) that may be rolled back;
        not needed where the snapshots can roll the whole next decode back but its first token."""
        if self.partial_rm:
            return
        if n_next is not None and n_next - 1 <= self.ctx.n_rs_seq:
            return
        self.checkpoint = (len(self.tokens), self.ctx.state_get())

    def extend(self, new: list[int], logits: str) -> None:
        n0 = len(self.tokens)
        self.tokens.extend(new)  # recorded first: an interruption leaves the list ahead of the memory
        self.ctx.decode(new, n0, logits=logits)

    def adopt(self, state: bytes, tokens: list[int], offset: int, sink: int) -> None:
        """Hold what another context of the same model holds (its memory, `state`): a window's tokens."""
        self.clear()
        self.ctx.state_set(state, partial=False)
        self.tokens[:] = tokens
        self.offset, self.sink = offset, sink

    def copy_prefix(self, src: Memory, n: int) -> int:
        """Hold the first n tokens that `src` (another sequence of the same context) holds, copied in the memory
        (llama_memory_seq_cp: in llama.cpp's unified cache the cells are shared, nothing is computed or copied;
        with a stream per sequence the stream's data is copied).
        Only for memories that drop positions freely and hold the history from its start (no draft window, no
        sliding window); returns the tokens now held (0: nothing copied)."""
        n = min(n, len(src.tokens), src.ctx.pos_max() + 1)
        if n <= 0 or not (self.partial_rm and src.partial_rm) or self.ctx.n_swa or self.offset or src.offset:
            return 0
        self.clear()
        self.tokens.extend(src.tokens[:n])  # recorded first, as extend does
        ctx = self.ctx.parent
        if ctx.unified:
            ctx.seq_cp(src.ctx.seq, self.ctx.seq, 0, n)
        else:  # a stream per sequence: llama.cpp copies whole streams only, so copy it all and drop the rest
            ctx.seq_cp(src.ctx.seq, self.ctx.seq)
            ctx.seq_rm(n, -1, self.ctx.seq)
        return n

    def view(self, history: list[int]) -> list[int]:
        """The tokens of `history` this memory is meant to hold (a window: the sinks, then the recent ones)."""
        return history[:self.sink] + history[self.offset:] if self.offset else history

    def next_index(self) -> int:
        """The history index of the next token to evaluate."""
        return self.offset + len(self.tokens) - self.sink

    def clear(self) -> None:
        self.offset = 0
        self.sink = 0
        self.tokens.clear()
        self.checkpoint = None
        self.ctx.clear()


def extend_many(parts: list[tuple[Memory, list[int], str]]) -> None:
    """Extend several sequences' memories of one model in one decode: (memory, tokens, logits) each, one memory
    per sequence; each records its tokens first, as `Memory.extend` does. A memory's rows are then read through
    its own context view (`ctx.logits`)."""
    parts = [p for p in parts if p[1]]
    if len(parts) <= 1:
        for m, new, logits in parts:
            m.extend(new, logits)
        return
    rows = []
    for m, new, logits in parts:
        rows.append((m.ctx.seq, new, len(m.tokens), logits))
        m.tokens.extend(new)
    parts[0][0].ctx.parent.decode_seqs(rows)


def extend_grouped(parts: list[tuple[Memory, list[int], str]], n_batch: int) -> int:
    """Prompts' tokens on their sequences (of a unified cache), in as few decodes of at most n_batch rows as their
    order allows (one longer than that alone, in chunks: extend_many of one part). The prompts that shared a
    decode with another's."""
    groups, rows = [[]], 0
    for part in (p for p in parts if p[1]):
        if groups[-1] and rows + len(part[1]) > n_batch:
            groups.append([])
            rows = 0
        groups[-1].append(part)
        rows += len(part[1])
    for group in groups:
        extend_many(group)
    return sum(len(g) for g in groups if len(g) > 1)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i
