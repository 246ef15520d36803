"""Draft/target vocabulary compatibility: llama.cpp's rule (common/speculative.cpp), as pure data checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ...errors import IncompatibleDraftError

MAX_VOCAB_SIZE_DIFFERENCE = 128
CHECK_START_TOKEN_ID = 5
VOCAB_TYPE_NAMES = {0: "none", 1: "SPM", 2: "BPE", 3: "WPM", 4: "UGM", 5: "RWKV", 6: "PLaMo-2", 7: "test"}


@dataclass(frozen=True)
class VocabInfo:
    """What the rule compares; `text(i)` returns token i's stored text."""

    path: str
    vocab_type: int
    add_bos: bool
    add_eos: bool
    bos: int
    eos: int
    n_vocab: int
    text: Callable[[int], bytes]

    @classmethod
    def of(cls, model) -> "VocabInfo":
        return cls(str(model.path), model.vocab_type, model.add_bos, model.add_eos, model.bos, model.eos,
                   model.n_vocab, model.token_text)


def first_text_difference(target: VocabInfo, draft: VocabInfo) -> int | None:
    """The first token id ≥ 5 whose text differs, or None."""
    for i in range(CHECK_START_TOKEN_ID, min(target.n_vocab, draft.n_vocab)):
        if target.text(i) != draft.text(i):
            return i
    return None


def check_compatible(target: VocabInfo, draft: VocabInfo) -> None:
    """Raise IncompatibleDraftError (naming both files and the difference) unless the draft may speculate."""
    where = f"target {target.path}, draft {draft.path}"
    fix = "use a draft of the same model family, or convert the pair with `specq convert`"
    if target.vocab_type != draft.vocab_type:
        raise IncompatibleDraftError(
            f"draft vocabulary type differs: target {VOCAB_TYPE_NAMES.get(target.vocab_type, target.vocab_type)}, "
            f"draft {VOCAB_TYPE_NAMES.get(draft.vocab_type, draft.vocab_type)} ({where}); {fix}")
    if target.add_bos != draft.add_bos or (target.add_bos and target.bos != draft.bos):
        raise IncompatibleDraftError(
            f"draft BOS handling differs: add_bos {target.add_bos}/{draft.add_bos}, "
            f"bos id {target.bos}/{draft.bos} ({where}); {fix}")
    if target.add_eos != draft.add_eos or (target.add_eos and target.eos != draft.eos):
        raise IncompatibleDraftError(
            f"draft EOS handling differs: add_eos {target.add_eos}/{draft.add_eos}, "
            f"eos id {target.eos}/{draft.eos} ({where}); {fix}")
    diff = abs(target.n_vocab - draft.n_vocab)
    if diff > MAX_VOCAB_SIZE_DIFFERENCE:
        raise IncompatibleDraftError(
            f"vocabulary sizes differ by {diff} > {MAX_VOCAB_SIZE_DIFFERENCE}: target {target.n_vocab}, "
            f"draft {draft.n_vocab} ({where}); {fix}")
    i = first_text_difference(target, draft)
    if i is not None:
        raise IncompatibleDraftError(
            f"token {i} differs: target {target.text(i)!r}, draft {draft.text(i)!r} ({where}); {fix}")
