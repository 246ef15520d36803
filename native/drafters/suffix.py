"""Suffix decoding: propose what followed the text's ending in earlier answers (a store every sequence and request
of an engine shares) or in this request's own text, as SuffixDecoding does (Arctic Inference; vLLM's
`method: "suffix"`).

Each index finds the occurrences of the text's longest ending (at most MAX_DEPTH tokens, at least KEY) and grows a
path from there, each token the one that followed most often among the occurrences still on the path; the path's
estimated probability is the product of those shares, and the path stops below MIN_TOKEN_PROB, or at
MAX_SPEC_FACTOR times the match's length: a short, common match drafts a token or two, a long copied passage many.
Of the two indexes, the one whose path expects more accepted tokens proposes (chosen before anything is drawn).

The store holds answers only (a shared system prompt would dominate its counts), each with the last PROMPT_TAIL
tokens of its prompt before it (so that an answer's opening can match), bounded by tokens and answers (oldest out
first). An answer enters it when a generation that could draft with this drafter (--drafter suffix or auto) ends
by itself: an interrupted or failed one's partial output never does, nor a target-alone reference's (bench's
baseline, draft_max 0).

Greedy, the path's tokens are the proposal. At T > 0 (rejection sampling) a draft is drawn a token at a time from
the followers' counts (`draw`: the shares below MIN_TOKEN_PROB dropped, the rest renormalised, and under a
constraint its forbidden tokens dropped and renormalised again), and that law is the verify's q; it stops only
before a draw, so every drawn token keeps its law. With `sampled` off, the greedy path is proposed as point masses
(as the n-gram drafter's), exact as well. Either way the output's law is the target's; what the store holds (what
the engine served before) changes which random draws a seeded answer uses, so a seeded answer at T > 0 depends on
the requests served before it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import ClassVar, NamedTuple, Sequence, TYPE_CHECKING

import numpy as np

from ...atomic import atomic_output
from ..core.sampling import Sampling, SparseDist, sample
from .base import Drafter, Proposal
from .ngram import only_grew, point_mass

if TYPE_CHECKING:
    from ..core.settings import GenerationSettings
    from ..runtime.engine import Engine

KEY = 3  # tokens an occurrence is looked up by: the shortest match that drafts
MAX_DEPTH = 24  # the longest ending matched (vLLM's suffix_decoding_max_tree_depth)
MAX_SPEC_FACTOR = 1.0  # a draft is at most this many times the match's length (vLLM's default)
MIN_TOKEN_PROB = 0.1  # a path stops where its estimated probability falls below this (vLLM's default)
EVIDENCE_MATCH = (KEY, 6, 12, 24)  # match lengths --drafter auto learns acceptance apart from (evidence)
MAX_CANDIDATES = 64  # the most recent occurrences of an ending's last KEY tokens looked at
STORE_TOKENS = 1_000_000  # the store's bounds (oldest answers out first)
STORE_ANSWERS = 10_000
PROMPT_TAIL = 8  # tokens of an answer's prompt stored before it
SAVE_EVERY_S = 300.0  # --suffix-cache: the store is written this often while answers come (and at exit)
MAGIC = b"SPECQSFX\x01"  # the cache file's first bytes (format 1)

log = logging.getLogger("specq.engine")


class Continuation(NamedTuple):
    """A proposed continuation: its tokens, the estimated probability of reaching each, and the match it grew
    from (tokens)."""

    tokens: list[int]
    probs: list[float]
    match: int

    @property
    def expected(self) -> float:
        """Tokens it expects accepted, by its own estimate."""
        return sum(self.probs)


NO_PATH = Continuation([], [], 0)


class SuffixIndex:
    """Sequences of tokens, looked up by every KEY-token window: the occurrences of a text's ending and what
    followed them (the MAX_CANDIDATES most recent). A sequence may grow at its end (`extend`) and be dropped
    (`drop`)."""

    def __init__(self):
        self.seqs: dict[int, list[int]] = {}
        self.where: dict[tuple[int, ...], deque] = {}  # KEY tokens → (sequence, position after them), oldest first
        self.n_tokens = 0

    def extend(self, sid: int, tokens: Sequence[int]) -> None:
        seq = self.seqs.setdefault(sid, [])
        for tok in tokens:
            seq.append(int(tok))
            if len(seq) >= KEY:
                self.where.setdefault(tuple(seq[-KEY:]), deque()).append((sid, len(seq)))
        self.n_tokens += len(tokens)

    def drop(self, sid: int) -> None:
        """Forget a sequence. Its occurrences go with it where they lead their windows' lists (the oldest
        sequence, as the store drops them); any others are skipped when looked at."""
        seq = self.seqs.pop(sid, [])
        self.n_tokens -= len(seq)
        for end in range(KEY, len(seq) + 1):
            key = tuple(seq[end - KEY:end])
            found = self.where.get(key)
            while found and found[0][0] == sid:
                found.popleft()
            if found is not None and not found:
                del self.where[key]

    def path(self, ending: Sequence[int], n_max: int) -> Continuation:
        """The continuation of `ending` (see the module's docstring), at most n_max tokens: from occurrences that
        something followed (in this request's own text, not the ending itself)."""
        if n_max < 1:
            return NO_PATH
        at, match = self.occurrences(ending)
        return grow(at, match, n_max)

    def occurrences(self, ending: Sequence[int]) -> tuple[list[tuple[list[int], int]], int]:
        """The occurrences of `ending`'s longest matched ending that something followed (each a sequence and the
        position after it; among the MAX_CANDIDATES most recent of its last KEY tokens), and the match's length."""
        found = self.where.get(tuple(ending[-KEY:])) if len(ending) >= KEY else None
        if not found:
            return [], 0
        tail = list(ending[-MAX_DEPTH:])
        best, at = 0, []
        for n_seen, (sid, pos) in enumerate(reversed(found)):
            if n_seen >= MAX_CANDIDATES:
                break
            seq = self.seqs.get(sid)
            if seq is None:  # dropped
                continue
            if pos >= len(seq):
                continue  # nothing followed it (yet)
            n = match_length(seq, pos, tail)
            if n > best:
                best, at = n, [(seq, pos)]
            elif n == best:
                at.append((seq, pos))
        return at, best


def match_length(seq: list[int], pos: int, tail: list[int]) -> int:
    """How many of tail's last tokens seq holds just before pos."""
    n, most = 0, min(len(tail), pos)
    while n < most and seq[pos - 1 - n] == tail[-1 - n]:
        n += 1
    return n


def followers(at: list[tuple[list[int], int]], depth: int) -> dict[int, int]:
    """How often each token followed, `depth` tokens after the match, among the occurrences `at`."""
    counts: dict[int, int] = {}
    for seq, pos in at:
        if pos + depth < len(seq):
            tok = seq[pos + depth]
            counts[tok] = counts.get(tok, 0) + 1
    return counts


def on_path(at: list[tuple[list[int], int]], depth: int, tok: int) -> list[tuple[list[int], int]]:
    """The occurrences of `at` that `tok` followed, `depth` tokens after the match."""
    return [(seq, pos) for seq, pos in at if pos + depth < len(seq) and seq[pos + depth] == tok]


def grow(at: list[tuple[list[int], int]], match: int, n_max: int) -> Continuation:
    """The path from the occurrences `at` (each a sequence and the position after the match): each token the one
    that followed most often among those still on the path, while the path's probability (the product of the
    shares; an occurrence whose sequence ended counts against it) stays at least MIN_TOKEN_PROB."""
    most = min(n_max, int(MAX_SPEC_FACTOR * match))
    tokens: list[int] = []
    probs: list[float] = []
    p, depth = 1.0, 0
    while at and len(tokens) < most:
        counts = followers(at, depth)
        if not counts:
            break
        tok = max(counts, key=counts.__getitem__)
        p *= counts[tok] / len(at)
        if p < MIN_TOKEN_PROB:
            break
        tokens.append(tok)
        probs.append(p)
        at = on_path(at, depth, tok)
        depth += 1
    return Continuation(tokens, probs, match)


def evidence_key(source: str, match: int) -> str:
    """A proposal's evidence key: its source ("store" or "text") and the EVIDENCE_MATCH bucket of its match."""
    return f"{source}:{max(b for b in EVIDENCE_MATCH if b <= match)}"


def count_law(counts: dict[int, int], allowed: np.ndarray | None) -> SparseDist | None:
    """The law a sampled draft draws a token from: the followers' shares, those below MIN_TOKEN_PROB dropped and
    the rest renormalised, then (under a constraint) the tokens it forbids dropped and renormalised again; None
    where nothing is left. It is the q of the verify's rejection sampling."""
    ids = np.fromiter(counts, np.int32, len(counts))
    w = np.fromiter(counts.values(), np.float64, len(counts))
    w /= w.sum()
    keep = w >= MIN_TOKEN_PROB
    if allowed is not None:
        keep &= np.array([t < len(allowed) and bool(allowed[t]) for t in ids.tolist()])
    if not keep.any():
        return None
    return SparseDist(ids[keep], w[keep] / w[keep].sum())


def draw(at: list[tuple[list[int], int]], match: int, n_max: int, samp: Sampling) -> tuple[list[int], list]:
    """A draft sampled along the occurrences `at` (a token at a time from count_law, with samp's generator), and
    each token's law. It stops before a draw, never after: at the length grow would allow (n_max and the match's
    share), or where even the likeliest follower would take the path's probability (the product of the drawn
    tokens' shares, as grow's) below MIN_TOKEN_PROB; a drawn token is always kept, so each keeps its law."""
    most = min(n_max, int(MAX_SPEC_FACTOR * match))
    drafts: list[int] = []
    dists: list[SparseDist] = []
    p = 1.0
    while at and len(drafts) < most:
        depth = len(drafts)
        counts = followers(at, depth)
        if not counts or p * max(counts.values()) / len(at) < MIN_TOKEN_PROB:
            break
        guide = samp.guide
        q = count_law(counts, None if guide is None else guide.allowed(drafts, depth))
        if q is None:
            break
        tok = sample(q, samp.rng)
        p *= counts[tok] / len(at)
        drafts.append(tok)
        dists.append(q)
        at = on_path(at, depth, tok)
    return drafts, dists


class SuffixStore:
    """Earlier answers on one engine (Drafter.provide), shared by its sequences and requests: at most
    `max_tokens` tokens and `max_answers` answers, the oldest dropped first. With a `path` (--suffix-cache) it is
    read from there (`load`) and written back atomically, readable by its owner alone: every SAVE_EVERY_S while
    answers come (a copy of the answers' list on the engine thread, the writing on a thread of its own) and at
    close. `fingerprint`: the target's vocabulary's (a file made for another vocabulary is not read)."""

    def __init__(self, max_tokens: int = STORE_TOKENS, max_answers: int = STORE_ANSWERS, path: Path | None = None,
                 fingerprint: bytes = b""):
        self.max_tokens, self.max_answers = max_tokens, max_answers
        self.index = SuffixIndex()
        self.order: deque[int] = deque()
        self.next_id = 0
        self.path, self.fingerprint = path, fingerprint
        self.saved_at = time.monotonic()
        self.writer: threading.Thread | None = None
        self.n_saves = 0
        self.pause_s = 0.0  # the engine thread's longest pause for a save (the copy handed to the writer)
        self.learning = True  # answers enter it (bench turns it off: each run sees the store as loaded)

    def add(self, tokens: Sequence[int]) -> None:
        if len(tokens) <= KEY or len(tokens) > self.max_tokens:
            return
        self.index.extend(self.next_id, tokens)
        self.order.append(self.next_id)
        self.next_id += 1
        while len(self.order) > self.max_answers or self.index.n_tokens > self.max_tokens:
            self.index.drop(self.order.popleft())
        if self.path is not None and time.monotonic() - self.saved_at >= SAVE_EVERY_S:
            self.save_in_background()

    @property
    def n_answers(self) -> int:
        return len(self.order)

    def answers(self) -> list[list[int]]:
        """The answers, oldest first (the lists themselves: an answer never changes once stored)."""
        return [self.index.seqs[sid] for sid in self.order]

    def load(self) -> None:
        """Read the store from `path`, where a file is: one that is corrupt, truncated, foreign or made for another
        vocabulary is one warning and an empty store, never an error."""
        if self.path is None or not self.path.exists():
            return
        try:
            answers = read_cache(self.path.read_bytes(), self.fingerprint)
        except (OSError, ValueError) as e:
            log.warning("--suffix-cache %s: %s; starting with an empty store", self.path, e)
            return
        for tokens in answers:
            self.add(tokens)
        log.info("--suffix-cache %s: %d answers, %d tokens", self.path, self.n_answers, self.index.n_tokens)

    def save_in_background(self) -> None:
        """Write the store without holding the engine up: the answers' list copied here, written on a thread."""
        if self.writer is not None and self.writer.is_alive():
            return
        t0 = time.perf_counter()
        answers = self.answers()
        self.pause_s = max(self.pause_s, time.perf_counter() - t0)
        self.saved_at = time.monotonic()
        self.writer = threading.Thread(target=self._write, args=(answers,), name="specq-suffix-cache", daemon=True)
        self.writer.start()

    def _write(self, answers: list[list[int]]) -> None:
        try:
            with atomic_output(self.path) as tmp:
                with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                    f.write(cache_bytes(answers, self.fingerprint))
            self.n_saves += 1
        except OSError as e:  # a full disk, a folder gone: the last file written stays whole
            log.warning("--suffix-cache %s: not written (%s)", self.path, e.strerror or e)

    def close(self) -> None:
        """With the engine: wait for a save under way, then write the store as it ends."""
        if self.path is None:
            return
        if self.writer is not None:
            self.writer.join()
        self._write(self.answers())


def cache_bytes(answers: list[list[int]], fingerprint: bytes) -> bytes:
    """The cache file: MAGIC, the vocabulary's fingerprint (32 bytes), the answers' count and lengths (uint32), their
    tokens (int32), then a SHA-256 of all that."""
    lengths = np.array([len(a) for a in answers], dtype="<u4")
    tokens = np.fromiter((t for a in answers for t in a), dtype="<i4", count=int(lengths.sum()))
    body = b"".join((MAGIC, fingerprint.ljust(32, b"\0")[:32], np.uint32(len(answers)).astype("<u4").tobytes(),
                     lengths.tobytes(), tokens.tobytes()))
    return body + hashlib.sha256(body).digest()


def read_cache(data: bytes, fingerprint: bytes) -> list[list[int]]:
    """The answers of a cache file (cache_bytes); ValueError says why it cannot be read."""
    head = len(MAGIC) + 32 + 4
    if not data.startswith(MAGIC[:-1]):
        raise ValueError("not a specq suffix cache")
    if data[len(MAGIC) - 1:len(MAGIC)] != MAGIC[-1:]:
        raise ValueError("a suffix cache of another format")
    if len(data) < head + 32 or hashlib.sha256(data[:-32]).digest() != data[-32:]:
        raise ValueError("corrupt or truncated")
    if data[len(MAGIC):len(MAGIC) + 32] != fingerprint.ljust(32, b"\0")[:32]:
        raise ValueError("made for another vocabulary")
    n = int(np.frombuffer(data, "<u4", 1, len(MAGIC) + 32)[0])
    lengths = np.frombuffer(data, "<u4", n, head)
    tokens = np.frombuffer(data, "<i4", int(lengths.sum()), head + 4 * n)
    if head + 4 * n + 4 * int(lengths.sum()) + 32 != len(data):
        raise ValueError("corrupt or truncated")
    ends = np.cumsum(lengths)
    return [tokens[e - k:e].tolist() for e, k in zip(ends, lengths)]


def vocab_fingerprint(model) -> bytes:
    """A vocabulary's SHA-256 over its size and every token's text: a cache is read only by the same one."""
    h = hashlib.sha256(str(model.n_vocab).encode())
    for i in range(model.n_vocab):
        h.update(model.token_text(i) + b"\0")
    return h.digest()


class SuffixDrafter(Drafter):
    """--drafter suffix: what followed the text's ending in earlier answers (the engine's SuffixStore) or in this
    request's own text, whichever path expects more accepted tokens."""

    name = "suffix"
    on_match_only = True
    has_memory = False
    sampled: ClassVar[bool] = True  # at T > 0, drafts drawn from the followers' counts (draw), else point masses

    def __init__(self, session):
        super().__init__(session)
        self.text = SuffixIndex()  # this session's history, as one sequence (id 0)
        # (history length, n_max, path, source, the occurrences the path grew from)
        self._cached: tuple[int, int, Continuation, str, list] | None = None
        self.on = False  # the running generation may draft with it (attach)

    @classmethod
    def provide(cls, engine: Engine) -> SuffixStore | None:
        """The engine's store (None with --suffix-scope request: each request keeps to its own text), read from
        --suffix-cache where given."""
        cfg = engine.config
        if cfg.suffix_scope == "request":
            return None
        if cfg.suffix_cache is None:
            return SuffixStore()
        store = SuffixStore(path=Path(cfg.suffix_cache), fingerprint=vocab_fingerprint(engine.target))
        store.load()
        return store

    def _sync(self) -> None:
        """Index the history: what it grew by, or all of it again where it was cut back or changed."""
        hist, seq = self.session.history, self.text.seqs.get(0, [])
        if not only_grew(hist, seq):
            self.text, seq = SuffixIndex(), []
        self.text.extend(0, hist[len(seq):])

    def _lookup(self, n_max: int) -> tuple[Continuation, str, list]:
        """The path to propose, its source and the occurrences it grew from (a sampled draft draws along them);
        looked up once a step. Under --drafter auto too: its longer matches than the n-gram lookup's, learnt apart
        by evidence, are what auto picks it for on copies."""
        hist = self.session.history
        if self._cached is not None and self._cached[:2] == (len(hist), n_max):
            return self._cached[2:]
        store_at, store_match = self.shared.index.occurrences(hist) if self.shared is not None else ([], 0)
        self._sync()
        own_at, own_match = self.text.occurrences(hist)
        store, own = grow(store_at, store_match, n_max), grow(own_at, own_match, n_max)
        got = (store, "store", store_at) if store.expected > own.expected else (own, "text", own_at)
        self._cached = (len(hist), n_max, *got)
        return got

    def limit(self, n_max: int, s: GenerationSettings) -> int:
        return len(self._lookup(n_max)[0].tokens)

    def evidence(self, n_max: int, s: GenerationSettings) -> str | None:
        """Where its path comes from and how long a match it grew from (at least 3, 6, 12 or 24 tokens): a long
        match is a copy, accepted far more often than a short one's guess (--drafter auto learns each apart)."""
        path, source, _ = self._lookup(n_max)
        if not path.tokens:
            return None
        return evidence_key(source, path.match)

    def propose(self, n_max: int, s: GenerationSettings, samp: Sampling) -> Proposal:
        path, source, at = self._lookup(n_max)
        if samp.draft_tf is None or not path.tokens:
            return Proposal(list(path.tokens), source=source)
        if not self.sampled:
            return Proposal(list(path.tokens), [point_mass(t) for t in path.tokens], source=source)
        drafts, dists = draw(at, path.match, n_max, samp)
        return Proposal(drafts, dists, source=source)

    def attach(self, on: bool) -> None:
        self.on = on

    def ended(self, prompt: list[int], output: list[int], interrupted: bool) -> None:
        if self.on and not interrupted and output and self.shared is not None and self.shared.learning:
            self.shared.add(list(prompt[-PROMPT_TAIL:]) + list(output))

    def clear(self) -> None:
        self.text, self._cached = SuffixIndex(), None
