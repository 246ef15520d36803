"""Constrained output (a JSON schema, any JSON object, a Lark or GBNF grammar) through llguidance, exact under
speculation.

- `Constraint`: what a generation asks for (GenerationSettings.constraint): the kind, the text, and an optional
  `after` marker: the constraint applies only to the tokens after that text first appears in the output (a
  reasoning model thinks first, then answers under the constraint). The constraint starts at the first token
  boundary after the marker's end.
- `compile_constraint`: the grammar checked and built once per text (cached), bounded in size and time; a server
  runs it on its request thread, never on the engine's.
- `Guide`: one generation's matcher, kept in step with the committed tokens and each step's drafts. The mask at a
  position is the grammar's after the committed tokens and the drafts before it; it masks the draft's rows as it
  drafts (drafters/base.py), cuts a proposal at its first token the grammar forbids (an n-gram's), and masks
  each of the target's verify rows (Session._accept): greedy and rejection sampling then run on the masked
  (renormalised) distributions, so the output follows the target's own constrained law. A rejected draft's
  tokens are rolled back out of the matcher the next time the guide is asked (`rollback`).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence, TYPE_CHECKING

import numpy as np

from ...errors import UsageError

if TYPE_CHECKING:
    from ..llama.ffi import Model

KINDS = ("json_schema", "json_object", "lark", "gbnf")
MAX_GRAMMAR_BYTES = 32 * 1024  # a schema or grammar's text, at most
COMPILE_TIMEOUT_S = 5.0  # checking and building one grammar, at most
CACHE_SIZE = 64  # compiled grammars kept, by their text


class ConstraintError(UsageError):
    """A constraint that cannot be used: its text does not compile, or it is over a bound."""


@dataclass(frozen=True)
class Constraint:
    kind: str  # one of KINDS
    text: str = ""  # the JSON schema (json_schema), the grammar (lark, gbnf); "" for json_object
    after: str | None = None  # the constraint starts after this text first appears in the output
    lenient: bool = False  # json_schema: ignore keywords llguidance does not implement (OpenAI's strict: false)
    compiled: object = field(default=None, compare=False, repr=False)  # a fresh llguidance LLMatcher

    def grammar(self) -> str:
        """llguidance's grammar for it (not yet checked)."""
        import llguidance as llg

        if self.kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"})
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.text)
            except ValueError as e:
                raise ConstraintError(f"the JSON schema is not valid JSON ({e})")
            if not isinstance(schema, (dict, bool)):
                raise ConstraintError("the JSON schema must be an object")
            return llg.LLMatcher.grammar_from_json_schema(schema, overrides={"lenient": self.lenient})
        if self.kind == "lark":
            return llg.LLMatcher.grammar_from_lark(self.text)
        if self.kind == "gbnf":
            try:
                return llg.grammar_from("gbnf", self.text)
            except Exception as e:  # the converter raises its own and plain exceptions
                raise ConstraintError(f"the GBNF grammar does not parse: {_one_line(e)}")
        raise ConstraintError(f"unknown constraint kind {self.kind!r}; use one of {', '.join(KINDS)}")


_LOCK = threading.Lock()
_COMPILED: "OrderedDict[tuple, object]" = OrderedDict()
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="specq-grammar")


def _one_line(e: object, most: int = 300) -> str:
    s = " ".join(str(e).split())
    return s if len(s) <= most else s[:most] + "…"


def _build(tokenizer, c: Constraint):
    import llguidance as llg

    grammar = c.grammar()
    err = llg.LLMatcher.validate_grammar(grammar, tokenizer)
    if err and not err.startswith("WARNING"):
        raise ConstraintError(f"the grammar does not compile: {_one_line(err)}")
    m = llg.LLMatcher(tokenizer, grammar, log_level=0)
    if m.is_error():
        raise ConstraintError(f"the grammar does not compile: {_one_line(m.get_error())}")
    return m


def compile_constraint(model: Model, c: Constraint, timeout_s: float = COMPILE_TIMEOUT_S) -> Constraint:
    """`c` with its compiled matcher: built once per (model, kind, text) and kept (the CACHE_SIZE most recent);
    ConstraintError where the text is over MAX_GRAMMAR_BYTES, does not compile, or takes over timeout_s."""
    from ..llama.guidance import lltokenizer

    if c.kind not in KINDS:
        raise ConstraintError(f"unknown constraint kind {c.kind!r}; use one of {', '.join(KINDS)}")
    size = len(c.text.encode("utf-8", "replace"))
    if size > MAX_GRAMMAR_BYTES:
        raise ConstraintError(f"the {'schema' if c.kind == 'json_schema' else 'grammar'} is {size} bytes, over "
                              f"the limit of {MAX_GRAMMAR_BYTES}; send a smaller one")
    tokenizer = lltokenizer(model)
    key = _cache_key(tokenizer, c)
    with _LOCK:
        got = _COMPILED.get(key)
        if got is not None:
            _COMPILED.move_to_end(key)
            return replace(c, compiled=got[1])
    job = _POOL.submit(_build, tokenizer, c)
    try:
        got = job.result(timeout=timeout_s)
    except FutureTimeout:
        raise ConstraintError(f"compiling the grammar took over {timeout_s:g} s; send a simpler one")
    with _LOCK:
        _COMPILED[key] = (tokenizer, got)
        while len(_COMPILED) > CACHE_SIZE:
            _COMPILED.popitem(last=False)
    return replace(c, compiled=got)


def compiled_for(model: Model, c: Constraint) -> bool:
    """Whether c's matcher was compiled for this model's tokenizer (compile_constraint's cache holds it there). A
    matcher made for another model keeps that model's vocabulary pointer, which is freed once it closes: never
    used with another."""
    from ..llama.guidance import lltokenizer

    with _LOCK:
        got = _COMPILED.get(_cache_key(lltokenizer(model), c))
    return got is not None and got[1] is c.compiled


def _cache_key(tokenizer, c: Constraint) -> tuple:
    """compile_constraint's cache key: a tokenizer and a constraint's text (an entry holds its tokenizer, so the
    id stays its own)."""
    return id(tokenizer), c.kind, c.text, c.lenient


def apply_mask(row: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """A copy of a logits row with every id the mask does not allow at -inf (ids past the mask's end too)."""
    out = np.full(row.shape[0], -np.inf, np.float32)
    n = min(row.shape[0], allowed.shape[0])
    np.copyto(out[:n], row[:n], where=allowed[:n])
    return out


class Guide:
    """One generation's constraint: a matcher in step with `done` (the generation's committed tokens, a list that
    grows in place) and the drafts asked about. `allowed(drafts, i)`: the ids the grammar allows after the
    committed tokens and drafts[:i] (None before the `after` marker)."""

    def __init__(self, c: Constraint, model: Model, done: list[int], clock: Callable[[], float] = time.perf_counter):
        if c.compiled is None or not compiled_for(model, c):
            c = compile_constraint(model, replace(c, compiled=None))
        self.m = c.compiled.deep_copy()
        from ..llama.guidance import lltokenizer

        tok = lltokenizer(model)
        self.n_vocab = tok.vocab_size
        # An end-of-generation token ends the answer: it is checked against the mask but never fed to the matcher
        # (llguidance does not count an EOS fed to a stopped matcher as a token, so a rollback would go too far).
        self.eog = frozenset(tok.eos_tokens)
        self.eos = model.eos if 0 <= model.eos < self.n_vocab else 0
        self.piece = model.piece
        self.done = done
        self.seen: list[int] = []  # the tokens fed: committed ones, then the drafts last asked about
        self._ok = 0  # seen[:_ok] == done[:_ok]
        self.after = (c.after or "").encode()
        self.start: int | None = None if self.after else 0  # the first token the matcher consumes (seen index)
        self._text = bytearray()  # before the marker: the text of `seen`, and where each token ends in it
        self._ends: list[int] = []
        self._masks: dict[int, np.ndarray] = {}  # by position in `seen`
        self._clock = clock
        self.n_masks = 0  # masks computed (each position once)
        self.n_cut = 0  # proposals cut at a token the grammar forbids
        self.n_unforced = 0  # drafted tokens proposed where the grammar allowed more than one token
        self._choice: dict[int, bool] = {}  # by position: whether its mask allows more than one token
        self.n_rows = 0  # logits rows masked (draft and target)
        self.mask_s = 0.0

    # ---- keeping in step --------------------------------------------------------------------------------
    def _at(self, drafts: Sequence[int], i: int) -> None:
        """Make `seen` the committed tokens followed by drafts[:i], feeding and rolling back the fewest."""
        done, seen = self.done, self.seen
        n, c = len(done), self._ok
        lim = min(len(seen), n)
        while c < lim and seen[c] == done[c]:
            c += 1
        if c < lim:
            self._cut(c)
        for t in done[len(self.seen):]:
            self._feed(t)
        self._ok = n
        for k in [k for k in self._masks if k < n]:
            del self._masks[k]
            self._choice.pop(k, None)
        j = 0
        while j < i and n + j < len(self.seen) and self.seen[n + j] == drafts[j]:
            j += 1
        self._cut(n + j)
        for t in drafts[j:i]:
            self._feed(int(t))

    def _feed(self, t: int) -> None:
        seen = self.seen
        if self.start is None:
            before = len(self._text)
            self._text += self.piece(t)
            self._ends.append(len(self._text))
            seen.append(t)
            if self._text.find(self.after, max(0, before - len(self.after) + 1)) >= 0:
                self.start = len(seen)
            return
        mask = self._masks.get(len(seen))
        forbidden = mask is not None and not (t < len(mask) and mask[t])
        if forbidden or t not in self.eog and not self.m.consume_token(t):
            raise RuntimeError(f"token {t} fed to the grammar where it is not allowed ({self.m.get_error()})")
        seen.append(t)

    def _cut(self, n: int) -> None:
        """Keep seen[:n]: roll the matcher back (or forget the marker) past it."""
        seen = self.seen
        if n >= len(seen):
            return
        if self.start is not None and n >= self.start:
            self.m.rollback(sum(1 for t in seen[n:] if t not in self.eog))
        else:
            if self.start is not None:
                self.m.reset()
                self.start = None
            del self._text[self._ends[n - 1] if n else 0:]
            del self._ends[n:]
        del seen[n:]
        for k in [k for k in self._masks if k > n]:
            del self._masks[k]
            self._choice.pop(k, None)
        self._ok = min(self._ok, n)

    # ---- masks -----------------------------------------------------------------------------------------
    def allowed(self, drafts: Sequence[int] = (), i: int = 0) -> np.ndarray | None:
        """A bool per tokenizer id: what the grammar allows after the committed tokens and drafts[:i]; None
        where the constraint has not started (before the `after` marker)."""
        self._at(drafts, i)
        if self.start is None:
            return None
        k = len(self.seen)
        got = self._masks.get(k)
        if got is None:
            t0 = self._clock()
            bits = np.zeros((self.n_vocab + 31) // 32, np.int32)
            self.m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
            got = np.unpackbits(bits.view(np.uint8), bitorder="little")[:self.n_vocab].view(bool)
            if not got.any():  # a matcher in an error state allows nothing: end the answer
                got = got.copy()
                got[self.eos] = True
            self._masks[k] = got
            self.n_masks += 1
            self.mask_s += self._clock() - t0
        return got

    def row(self, row: np.ndarray, drafts: Sequence[int], i: int) -> np.ndarray:
        """A logits row for the position after drafts[:i], masked where the constraint applies."""
        a = self.allowed(drafts, i)
        if a is None:
            return row
        self.n_rows += 1
        return apply_mask(row, a)

    def rows(self, logits: np.ndarray, drafts: Sequence[int]) -> np.ndarray:
        """The verify's rows [last, d1..dn], each masked at its own position."""
        return np.stack([self.row(logits[i], drafts, i) for i in range(len(drafts) + 1)])

    def allowed_prefix(self, drafts: Sequence[int]) -> int:
        """How many of the drafts the grammar allows in a row (a proposal is cut at its first forbidden one)."""
        for i, t in enumerate(drafts):
            a = self.allowed(drafts, i)
            if a is not None and not (t < len(a) and a[t]):
                self.n_cut += 1
                return i
            if a is not None:
                k = len(self.seen)
                if k not in self._choice:
                    self._choice[k] = int(np.count_nonzero(a)) > 1
                self.n_unforced += self._choice[k]
        return len(drafts)

    @property
    def active(self) -> bool:
        """Whether the constraint applies to the next committed token."""
        return self.allowed() is not None
