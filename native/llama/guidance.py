"""The bridge from a llama.cpp vocabulary to llguidance's tokenizer (constrained output: core/constraint.py).

Building it reads every token's bytes (~0.2-1 s on a 49k-248k vocabulary), so it is made once per model and
kept. Every end-of-generation token is an end of sentence to the grammar: where the grammar may end, any of them
may come (a chat model ends its turn with its own end token, not always the vocabulary's EOS)."""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

import llama_cpp as C

if TYPE_CHECKING:
    from .ffi import Model

_LOCK = threading.Lock()
_CACHE: "weakref.WeakKeyDictionary[Model, object]" = weakref.WeakKeyDictionary()


def eog_tokens(model: Model) -> list[int]:
    """The vocabulary's end-of-generation ids, its EOS first."""
    eos = model.eos
    out = [eos] if 0 <= eos < model.n_vocab else []
    out += [t for t in range(model.n_vocab) if t != eos and C.llama_vocab_is_eog(model.vocab, t)]
    return out


def lltokenizer(model: Model):
    """llguidance's LLTokenizer for this model's vocabulary (made once per model, thread-safe)."""
    with _LOCK:
        tok = _CACHE.get(model)
        if tok is None:
            from llguidance.llamacpp import lltokenizer_from_vocab

            tok = lltokenizer_from_vocab(model.vocab, eos_token=eog_tokens(model))
            _CACHE[model] = tok
        return tok
