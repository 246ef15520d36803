"""The bridge from a llama.cpp vocabulary to llguidance's tokenizer (constrained output: core/constraint.py).

Building it reads every token's bytes (~0.2-1 s on a 49k-248k vocabulary), so it is made once per model and
kept. Every end-of-generation token is an end of sentence to the grammar: where the grammar may end, any of them
may come (a chat model ends its turn with its own end token, not always the vocabulary's EOS)."""

from __future__ import annotations

import ctypes
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
            tok = _build(model)
            _CACHE[model] = tok
        return tok


def _build(model: Model):
    """As llguidance.llamacpp.lltokenizer_from_vocab (which calls a deprecated llama.cpp function): each token's
    bytes, control tokens (and user-defined ones that look like them) marked with a leading 0xff."""
    from llguidance import LLTokenizer

    tokens = []
    for t in range(model.n_vocab):
        piece = model.piece(t)
        attr = C.llama_vocab_get_attr(model.vocab, t)
        if attr & C.LLAMA_TOKEN_ATTR_CONTROL or (attr & C.LLAMA_TOKEN_ATTR_USER_DEFINED and piece.startswith(b"<")
                                                 and piece.endswith(b">")):
            piece = b"\xff" + piece
        tokens.append(piece)
    fptr = ctypes.cast(C.llama_cpp._lib.llama_tokenize, ctypes.c_void_p).value
    return LLTokenizer.from_llamacpp(tokens=tokens, vocab_ptr=model.vocab, tokenize_fptr=fptr,
                                     eos_token=eog_tokens(model), slices=None)
