"""SentencePiece (Llama 2 / Mistral v0.1 style) checkpoints: llama.cpp tokenizes the converted GGUF exactly as
SentencePiece itself does, the logits match the numpy reference, and an SPM draft pair speculates."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import sentencepiece as spm

from hfmodels import (OTHER_CORPUS, TEST_TEXT, HFSpec, reference_logits, spm_hf_tokenizer, train_spm,
                      write_spm_checkpoint)
from specq.convert.pipeline import convert_pair
from specq.errors import ConversionError, IncompatibleDraftError
from specq.native.llama import ffi as _ffi
from specq.native.core.compat import VocabInfo, check_compatible
from specq.native.runtime.engine import Engine
from specq.native.core.settings import GenerationSettings

TEXTS = [
    TEST_TEXT,
    "Hello",
    " leading space, and two  spaces   then three",
    "\n\nnewlines first\nthen\r\nCRLF and trailing newline\n",
    "数字 1234567890 和 3.1415 以及 emoji 👩‍💻🧑🏽‍🚀 👍🏿",
    "    indented code\n\tif (a && b) { return x->y[3]; }\n",
    "今天天气很好，我们去公园散步。世界你好。",
    "<s> and </s> are plain text here; so is <unk>",
]
TARGET = HFSpec(arch="LlamaForCausalLM", seed=20)


@pytest.fixture(scope="module")
def proto() -> bytes:
    return train_spm()


def gguf_fields(path) -> dict:
    r = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items() if k.startswith("tokenizer.")}


def sp_ids(sp: spm.SentencePieceProcessor, text: str, add_bos: bool) -> list[int]:
    return ([sp.bos_id()] if add_bos else []) + sp.encode(text)


@pytest.mark.parametrize("quant", [None, "Q8_0"])
def test_vocabulary_and_tokenization_match_sentencepiece(tmp_path, proto, quant):
    src = write_spm_checkpoint(tmp_path / "hf", TARGET, proto)
    res = convert_pair(str(src), tmp_path / "out", quant=quant)
    sp = spm.SentencePieceProcessor(model_proto=proto)
    f = gguf_fields(res.target_path)
    n = sp.vocab_size()
    assert f["tokenizer.ggml.model"] == "llama" and f["tokenizer.ggml.pre"] == "default"
    assert f["tokenizer.ggml.tokens"] == [sp.id_to_piece(i) for i in range(n)]
    assert np.allclose(f["tokenizer.ggml.scores"][3:], [sp.get_score(i) for i in range(3, n)])
    types = f["tokenizer.ggml.token_type"]
    # as llama.cpp's converter: tokenizer_config's special added tokens (<unk> <s> </s>) become CONTROL
    assert types[:3] == [gguf.TokenType.CONTROL] * 3
    assert all((types[i] == gguf.TokenType.BYTE) == sp.is_byte(i) for i in range(3, n))
    assert all(types[i] in (gguf.TokenType.BYTE, gguf.TokenType.NORMAL) for i in range(3, n))
    assert (f["tokenizer.ggml.bos_token_id"], f["tokenizer.ggml.eos_token_id"],
            f["tokenizer.ggml.unknown_token_id"]) == (1, 2, 0)
    assert f["tokenizer.ggml.add_bos_token"] is True and f["tokenizer.ggml.add_eos_token"] is False
    assert f["tokenizer.ggml.add_space_prefix"] is True and f["tokenizer.ggml.remove_extra_whitespaces"] is False
    with _ffi.Model(res.target_path, vocab_only=True) as m:
        assert m.add_bos and m.bos == sp.bos_id() and m.eos == sp.eos_id() and m.is_eog(m.eos)
        assert "[INST]" in (m.chat_template() or "")
        for text in TEXTS:
            ids = m.tokenize(text, add_special=True, parse_special=False)
            assert ids == sp_ids(sp, text, m.add_bos), text
            # SentencePiece's dummy prefix is the one difference between raw pieces and sp.decode
            assert m.detokenize(ids[1:]) == " " + sp.decode(ids[1:]) == " " + text, text


def test_fixture_tokenizer_json_agrees(proto):
    """The tokenizer.json the fixture ships (LlamaConverter's layout) encodes as SentencePiece does."""
    sp, hf = spm.SentencePieceProcessor(model_proto=proto), spm_hf_tokenizer(proto)
    for text in TEXTS[:-1]:  # the last one: HF matches "<s>" in text as the special token, SentencePiece does not
        assert hf.encode(text).ids == sp_ids(sp, text, True), text


def test_tokenizer_model_alone(tmp_path, proto):
    """Checkpoints with tokenizer.model and no tokenizer.json (older Llama 2 uploads) convert the same."""
    src = write_spm_checkpoint(tmp_path / "hf", TARGET, proto, tokenizer_json=False)
    res = convert_pair(str(src), tmp_path / "out", quant=None)
    sp = spm.SentencePieceProcessor(model_proto=proto)
    with _ffi.Model(res.target_path, vocab_only=True) as m:
        for text in TEXTS:
            assert m.tokenize(text, add_special=True, parse_special=False) == sp_ids(sp, text, True), text


def test_logits_match_reference(tmp_path, proto):
    src = write_spm_checkpoint(tmp_path / "hf", TARGET, proto)
    res = convert_pair(str(src), tmp_path / "out", outtype="f32", quant=None)
    with _ffi.Model(res.target_path) as m, _ffi.Context(m, 128, 1, n_outputs_max=24) as c:
        tokens = m.tokenize(TEST_TEXT, add_special=True, parse_special=False)[:24]
        c.decode(tokens, 0, logits="all")
        got = np.array(c.logits(len(tokens)), dtype=np.float64)
    ref = reference_logits(src, TARGET, tokens)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < 2e-3, f"max relative logit error {err:.2e}"
    assert (got.argmax(1) == ref.argmax(1)).mean() > 0.9


def test_spm_pair_aligns_and_speculates(tmp_path, proto):
    tgt = write_spm_checkpoint(tmp_path / "t", HFSpec(arch="LlamaForCausalLM", extra_rows=8, seed=21), proto)
    dft = write_spm_checkpoint(tmp_path / "d", HFSpec(arch="LlamaForCausalLM", n_layer=1, tied=True, seed=22), proto)
    res = convert_pair(str(tgt), tmp_path / "pair", draft=str(dft), quant="Q8_0", draft_quant="Q8_0")
    with _ffi.Model(res.target_path, vocab_only=True) as t, _ffi.Model(res.draft_path, vocab_only=True) as d:
        check_compatible(VocabInfo.of(t), VocabInfo.of(d))
        assert d.n_vocab == t.n_vocab == spm.SentencePieceProcessor(model_proto=proto).vocab_size() + 8
    s = GenerationSettings(n_predict=24, draft_max=4)
    with Engine(res.target_path, res.draft_path, ctx=256, threads=1) as eng:  # 1: no spin-wait on a busy CPU
        prompt = eng.tokenize("The quick brown fox", add_special=True)
        assert prompt[0] == 1
        spec = eng.session().generate(prompt, s, speculative=True).run()
        base = eng.session().generate(prompt, s, speculative=False).run()
    assert spec.stats.n_drafted > 0
    assert spec.tokens == base.tokens and len(base.tokens) == 24


def test_different_spm_vocabulary_refused(tmp_path, proto):
    tgt = write_spm_checkpoint(tmp_path / "t", TARGET, proto)
    dft = write_spm_checkpoint(tmp_path / "d", HFSpec(n_layer=1), train_spm(corpus=OTHER_CORPUS))
    with pytest.raises(IncompatibleDraftError, match="differs from the target's at token"):
        convert_pair(str(tgt), tmp_path / "pair", draft=str(dft), quant=None, draft_quant=None)


def test_unigram_refused(tmp_path):
    src = write_spm_checkpoint(tmp_path / "hf", TARGET, train_spm(model_type="unigram"), tokenizer_json=False)
    with pytest.raises(ConversionError, match="SentencePiece unigram tokenizer"):
        convert_pair(str(src), tmp_path / "out", quant=None)
    assert not (tmp_path / "out").exists()


def test_byte_fallback_json_without_model_refused(tmp_path, proto):
    src = write_spm_checkpoint(tmp_path / "hf", TARGET, proto)
    (src / "tokenizer.model").unlink()
    assert json.loads((src / "tokenizer.json").read_text())["model"]["byte_fallback"] is True
    with pytest.raises(ConversionError, match="there is no tokenizer.model"):
        convert_pair(str(src), tmp_path / "out", quant=None)


def test_hub_download_takes_tokenizer_model():
    from huggingface_hub.utils import filter_repo_objects

    from specq.convert.source import HUB_PATTERNS

    repo = ["config.json", "tokenizer.model", "tokenizer.json", "tokenizer_config.json", "added_tokens.json",
            "model-00001-of-00002.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
            "consolidated.00.pth", "params.json"]
    got = set(filter_repo_objects(repo, allow_patterns=HUB_PATTERNS))
    assert {"tokenizer.model", "added_tokens.json", "model-00001-of-00002.safetensors"} <= got
    assert not got & {"pytorch_model.bin", "consolidated.00.pth"}
