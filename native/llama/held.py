"""llama.cpp calls of microseconds, made with the GIL held.

ctypes releases the GIL around every foreign call. Where another thread waits for it (specq serve's HTTP loop,
woken by the tokens just sent), a release may hand that thread the GIL, and then the engine's thread waits for
the end of its turn before the call returns (in tests/test_held_calls.py: none in 20 calls, many in 200). The functions here are the same
library's, bound through a PyDLL handle, which keeps the GIL; llama_decode and llama_synchronize still release
it, so the loop runs while the weights are read. None of them waits on a device: the decode's results are
waited for (llama_synchronize) before any of them reads them.
"""

from __future__ import annotations

import ctypes

import llama_cpp.llama_cpp as C

_lib = ctypes.PyDLL(C._lib._name, handle=C._lib._handle)


def _held(name: str):
    """llama-cpp-python's binding of `name`, its signature kept, called without releasing the GIL."""
    src, fn = getattr(C, name), getattr(_lib, name)
    fn.argtypes, fn.restype = src.argtypes, src.restype
    return fn


llama_get_logits = _held("llama_get_logits")
llama_memory_seq_rm = _held("llama_memory_seq_rm")
llama_memory_seq_pos_max = _held("llama_memory_seq_pos_max")
llama_memory_seq_pos_min = _held("llama_memory_seq_pos_min")
llama_vocab_is_eog = _held("llama_vocab_is_eog")
llama_token_to_piece = _held("llama_token_to_piece")
llama_sampler_sample = _held("llama_sampler_sample")
