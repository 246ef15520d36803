"""Draft alignment: give the draft the target's vocabulary rows so llama.cpp's compatibility rule passes.

Only padding rows may change: the real vocabularies must be identical. Padded draft rows get zero
embeddings, and output rows that can never win: on Qwen2 (which has an output bias) a very negative
bias; elsewhere an exact copy of a real token's row, which ties that lower id and so never is the
strict maximum (greedy argmax takes the first of equal values, in numpy and in llama.cpp).
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

from ..errors import IncompatibleDraftError
from .arch import ArchSpec
from .vocab import Vocab, first_difference

PAD_LOGIT_BIAS = -1.0e9


@dataclass(frozen=True)
class RowPlan:
    """How the draft's token_embd/output rows are reshaped."""

    n_rows_in: int
    n_rows_out: int
    pad_mode: str  # "none", "trim", "bias" (Qwen2 output bias) or "copy" (duplicate a real row)

    @property
    def padding(self) -> bool:
        return self.n_rows_out > self.n_rows_in


def check_same_vocabulary(target: Vocab, draft: Vocab) -> None:
    """Refuse a draft whose real vocabulary differs, naming the first differing id and both texts."""
    if target.model != draft.model:
        raise IncompatibleDraftError(
            f"draft tokenizer type differs: target {target.model}, draft {draft.model} ({draft.source}); "
            "choose a draft of the same model family")
    diff = first_difference(target, draft)
    if diff is not None and _target_only_added_tokens(target, draft, diff[0]):
        diff = None
    if diff is not None:
        i, a, b = diff
        raise IncompatibleDraftError(
            f"draft vocabulary differs from the target's at token {i}: target {a!r}, draft {b!r} "
            f"({target.source} vs {draft.source}); choose a draft of the same model family")
    n = min(target.n_real, draft.n_real)
    if target.scores is not None and draft.scores is not None and target.scores[:n] != draft.scores[:n]:
        i = next(i for i in range(n) if target.scores[i] != draft.scores[i])
        raise IncompatibleDraftError(
            f"draft SentencePiece scores differ from the target's at token {i} ({target.tokens[i]!r}: "
            f"{target.scores[i]} vs {draft.scores[i]}; {draft.source}); choose a draft of the same model family")
    if target.pre != draft.pre:
        raise IncompatibleDraftError(
            f"draft pre-tokenizer differs: target {target.pre}, draft {draft.pre} ({draft.source}); "
            "choose a draft of the same model family")


def _target_only_added_tokens(target: Vocab, draft: Vocab, first: int) -> bool:
    """The vocabularies agree up to the draft's end and the target only adds tokens after it, all added (control or
    user-defined) ones: Gemma-3-27B's <image_soft_token> at 262144, where the 1B/270M drafts end. The draft gets
    the target's texts there and padding rows, which never win its argmax."""
    added = (gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED)
    return first == draft.n_real < target.n_real and all(target.types[i] in added
                                                         for i in range(draft.n_real, target.n_real))


def plan_rows(draft: ArchSpec, n_rows_in: int, n_rows_out: int) -> RowPlan:
    if n_rows_out == n_rows_in:
        return RowPlan(n_rows_in, n_rows_out, "none")
    if n_rows_out < n_rows_in:
        return RowPlan(n_rows_in, n_rows_out, "trim")
    mode = "bias" if draft.arch == gguf.MODEL_ARCH.QWEN2 else "copy"
    return RowPlan(n_rows_in, n_rows_out, mode)


def pad_rows_zero(n_extra: int, tail: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Zero rows (all-zero bits are 0.0 in BF16, F16 and F32 alike)."""
    return np.zeros((n_extra,) + tuple(tail), dtype=dtype)


def output_bias(n_real_rows: int, n_rows_out: int) -> np.ndarray:
    """Zero for real rows (their logits are unchanged), very negative for the padding."""
    b = np.zeros(n_rows_out, dtype=np.float32)
    b[n_real_rows:] = PAD_LOGIT_BIAS
    return b
