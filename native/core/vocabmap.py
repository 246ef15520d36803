"""A draft of another vocabulary: what it shares with the target, and how text moves between the two tokenizers.

Glossary:
- classification (`classify`): "same" (llama.cpp's rule holds, equal sizes), "padded" (the rule holds, sizes differ
  by padding rows) or "different": the draft proposes through a translation (`--vocab-map`).
- text token: a token whose bytes are text (normal, byte-fallback and user-defined tokens); control, unknown and
  unused tokens are picked out by their llama.cpp attributes, never by their text, and never cross over.
- shared token: a draft text token whose bytes are exactly one target text token's bytes (compared as decoded
  bytes: SentencePiece's `▁`, byte-level BPE's `Ġ` and byte fallback `<0xNN>` all decode to plain bytes). Several
  draft tokens of the same bytes (SPM's `<0x20>` and `▁`) all map onto the one target id, their mass summed.
- TLI (token-level intersection, Timor et al. 2025): the draft's distribution restricted to its shared tokens,
  carried to target ids and renormalised there; drafted and verified as any distribution is.
- string path (SLEM): the draft drafts in its own vocabulary; its text is tokenized by the target's tokenizer
  after a short tail of committed text, and the target tokens after the tail are the proposal (a point mass),
  less the last word, whose split more text could still change.
- overlap (`vocab_overlap`): the share of the draft's probability mass on shared tokens over a calibration text.
"""

from __future__ import annotations

import numpy as np

from ...errors import IncompatibleDraftError
from .compat import VocabInfo, check_compatible
from .sampling import SparseDist

SAME, PADDED, DIFFERENT = "same", "padded", "different"
TLI, STRING, AUTO = "tli", "string", "auto"
VOCAB_MAPS = (AUTO, TLI, STRING)
SHARED_MIN = 0.02  # TLI stops drafting where less of the draft's mass than this is on shared tokens
DRAFT_CTX_FACTOR = 1.5  # such a draft's context against the target's: its tokenizer may need more tokens
# Below this overlap TLI cannot help (measured on Gemma-deep <- SmolLM2 with shared tokens dropped at random,
# docs/benchmarks.md: per-position acceptance 0.21 at overlap 0.20, 0.11 at 0.14): --vocab-map tli is refused,
# auto drafts through the string path alone
OVERLAP_MIN = 0.2
CALIBRATION = (
    "The committee met on Tuesday to review the budget. Revenue rose 12% to $4.2 million, while costs fell.\n"
    "def parse(line: str) -> dict:\n    key, _, value = line.partition('=')\n    return {key.strip(): value}\n"
    "Q: What is the capital of France?\nA: Paris is the capital and largest city of France.\n"
)


def classify(target, draft) -> str:
    """How a draft's vocabulary relates to the target's (the module's glossary)."""
    try:
        check_compatible(VocabInfo.of(target), VocabInfo.of(draft))
    except IncompatibleDraftError:
        return DIFFERENT
    return SAME if target.n_vocab == draft.n_vocab else PADDED


def char_end(text: bytes | bytearray, end: int | None = None) -> int:
    """The largest n <= end (default len) such that text[:n] ends on a whole UTF-8 character."""
    n = len(text) if end is None else end
    i = n
    while i > 0 and i > n - 4 and (text[i - 1] & 0xC0) == 0x80:
        i -= 1
    if i > 0 and text[i - 1] >= 0xC0:  # a lead byte: how many bytes its character needs
        lead = text[i - 1]
        need = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
        return n if n - (i - 1) >= need else i - 1
    return n


class Tokenizer:
    """One model's vocabulary as text: each token's bytes, which tokens are text, and tokenizing text that starts
    at a token boundary inside a longer text (`tokenize`)."""

    def __init__(self, model):
        self.model = model
        n = model.n_vocab
        self.pieces = [model.piece(i) for i in range(n)]
        self.is_text = model.text_tokens() & np.array([len(p) > 0 and not model.is_eog(i) for i, p in enumerate(self.pieces)])
        # SentencePiece with add_space_prefix puts a space before the text (and after each special token)
        self.prefix_space = self.render(model.tokenize("a", add_special=False, parse_special=False)) == b" a"

    def render(self, tokens) -> bytes:
        return b"".join(self.pieces[t] for t in tokens)

    def tokenize(self, text: bytes, at_start: bool) -> list[int]:
        """The tokens of `text`, which begins at the start of the whole text (at_start) or at a token boundary
        inside it. A tokenizer that puts a space before the text is handed the text less its leading space, which
        it puts back (`boundary_ok` keeps such boundaries at a space)."""
        if self.prefix_space and not at_start and text[:1] == b" ":
            text = text[1:]
        return self.model.tokenize(bytes(text).decode("utf-8", "replace"), add_special=False, parse_special=True)

    def boundary_ok(self, text: bytes | bytearray, at: int) -> bool:
        """Whether text may be tokenized again from byte `at` (a token boundary) on its own: its start, or where a
        whole character starts (`starts_ok`)."""
        return at == 0 or self.starts_ok(bytes(text[at:at + 1]))

    def starts_ok(self, text: bytes) -> bool:
        """Whether a piece of text cut at a token boundary can be tokenized on its own: it starts with a whole
        character, and with a space-prefixing tokenizer, with a space."""
        return bool(text) and (text[0] & 0xC0) != 0x80 and (not self.prefix_space or text[0] == 0x20)

    def ends(self, tokens: list[int], start: int, n_bytes: int) -> list[int]:
        """Each token's end as a byte offset into the whole text, for tokens of the n_bytes bytes from `start`
        (a prefix space the tokenizer added is not counted)."""
        lengths = np.cumsum([len(self.pieces[t]) for t in tokens], dtype=np.int64)
        extra = int(lengths[-1]) - n_bytes if len(tokens) else 0
        return [start + min(max(int(x) - max(extra, 0), 0), n_bytes) for x in lengths]

    def single(self, piece: bytes, ids: list[int]) -> int:
        """Of several ids with the same bytes, the one this tokenizer makes of them alone (else the lowest)."""
        got = self.tokenize(piece, at_start=not piece.startswith(b" ")) if piece else []
        return got[0] if len(got) == 1 and got[0] in ids else min(ids)


class VocabBridge:
    """The shared tokens of a draft and a target vocabulary (the module's glossary) and the maps between them."""

    def __init__(self, target: Tokenizer, draft: Tokenizer):
        self.target, self.draft = target, draft
        self.n_target = len(target.pieces)
        by_bytes: dict[bytes, list[int]] = {}
        for t in np.flatnonzero(target.is_text):
            by_bytes.setdefault(target.pieces[t], []).append(int(t))
        t_of = {p: ids[0] if len(ids) == 1 else target.single(p, ids) for p, ids in by_bytes.items()}
        self.d2t = np.full(len(draft.pieces), -1, dtype=np.int64)
        for d in np.flatnonzero(draft.is_text):
            self.d2t[d] = t_of.get(draft.pieces[d], -1)
        self._index()

    def drop(self, draft_ids: np.ndarray) -> None:
        """Share these draft tokens no more (benchmarks/drafters.py --drop-shared lowers the overlap with it)."""
        self.d2t[draft_ids] = -1
        self._index()

    def _index(self) -> None:
        """The maps that follow from d2t."""
        draft = self.draft
        self.shared_d = np.flatnonzero(self.d2t >= 0)
        self.shared_t = self.d2t[self.shared_d]
        # the draft token fed to the draft's memory for a drafted target id: the draft's own choice of those bytes
        groups: dict[int, list[int]] = {}
        for d in self.shared_d:
            groups.setdefault(int(self.d2t[d]), []).append(int(d))
        self.t2d = {t: ds[0] if len(ds) == 1 else draft.single(draft.pieces[ds[0]], ds) for t, ds in groups.items()}
        self.groups = {t: np.array(ds) for t, ds in groups.items() if len(ds) > 1}  # several draft ids, one target id
        self.widest = max((len(ds) for ds in groups.values()), default=1)

    @property
    def n_shared(self) -> int:
        """Target ids reachable from the draft."""
        return len(self.t2d)

    def carry(self, dist: SparseDist) -> tuple[SparseDist, float] | None:
        """A distribution over draft ids carried to target ids: restricted to shared tokens, duplicates summed,
        renormalised over what is shared; and the mass that was shared. None where less than SHARED_MIN is."""
        t = self.d2t[dist.ids]
        keep = t >= 0
        if not keep.any():
            return None
        ids, where = np.unique(t[keep], return_inverse=True)
        probs = np.bincount(where, weights=dist.probs[keep], minlength=len(ids))
        mass = float(probs.sum())
        if mass < SHARED_MIN:
            return None
        return SparseDist(ids.astype(np.int32), probs / mass), mass

    def project(self, row: np.ndarray) -> tuple[np.ndarray, float]:
        """A draft logits row as a target logits row: each shared target id gets the log of the draft's summed
        probability on its tokens (the others -inf), and the share of the draft's mass that is shared."""
        z = np.asarray(row, dtype=np.float64)
        p = np.exp(z - z.max())
        total = p.sum()
        summed = np.bincount(self.shared_t, weights=p[self.shared_d], minlength=self.n_target)
        with np.errstate(divide="ignore"):
            out = np.log(summed / total).astype(np.float32)
        return out, float(summed.sum() / total)

    def greedy(self, row: np.ndarray, top: int = 32) -> tuple[int, float, float]:
        """project(row)'s argmax without projecting the whole row: (target id, its probability renormalised over
        the shared tokens, the shared mass). The `top` most probable shared draft tokens decide it whenever no
        target id outside them could sum to more (each sums at most `widest` draft tokens); else project()."""
        z = np.asarray(row, dtype=np.float64)
        p = np.exp(z - z.max())
        p /= p.sum()
        ps = p[self.shared_d]
        mass = float(ps.sum())
        k = min(top, len(ps))
        cand = np.argpartition(ps, -k)[-k:]
        best_t, best = -1, -1.0
        for t in {int(x) for x in self.shared_t[cand]}:
            g = self.groups.get(t)
            s = float(p[g].sum()) if g is not None else float(p[self.t2d[t]])
            if s > best:
                best_t, best = t, s
        if k < len(ps) and float(ps[cand].min()) * self.widest > best:
            projected, mass = self.project(row)
            best_t = int(projected.argmax())
            best = float(np.exp(projected[best_t]))
        return best_t, best / mass if mass > 0 else 0.0, mass

    def overlap(self, logits: np.ndarray) -> float:
        """The mean share of the draft's probability mass on shared tokens over rows of its logits."""
        return float(np.mean([self.project(r)[1] for r in logits])) if len(logits) else 0.0
