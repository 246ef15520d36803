"""Draft alignment: padded and trimmed embedding/output rows, refused vocabularies, and a pair the engine runs."""

from __future__ import annotations

import numpy as np
import pytest

from hfmodels import OTHER_CORPUS, TEST_TEXT, HFSpec, write_checkpoint
from specq.convert.pipeline import convert_pair
from specq.errors import IncompatibleDraftError
from specq.native.llama import ffi as _ffi
from specq.native.core.compat import VocabInfo, check_compatible
from specq.native.runtime.engine import Engine
from specq.native.core.settings import GenerationSettings

TARGET = HFSpec(arch="Qwen2ForCausalLM", extra_rows=24, seed=10)


def draft_logits(path, tokens):
    with _ffi.Model(path) as m, _ffi.Context(m, 128, 2, n_outputs_max=len(tokens)) as c:
        c.decode(tokens, 0, logits="all")
        return np.array(c.logits(len(tokens)))


def prompt_tokens(path, n=40):
    with _ffi.Model(path, vocab_only=True) as m:
        return m.tokenize(TEST_TEXT * 2, add_special=False)[:n]


@pytest.mark.parametrize("draft_spec,mode", [
    (HFSpec(arch="Qwen2ForCausalLM", n_layer=1, tied=True, seed=11), "bias"),  # Qwen2.5 0.5B-like: tied, fewer rows
    (HFSpec(arch="LlamaForCausalLM", n_layer=1, seed=12), "copy"),
    (HFSpec(arch="Qwen3ForCausalLM", n_layer=1, tied=True, head_dim=16, seed=13), "copy"),
])
def test_padded_rows_never_win(tmp_path, draft_spec, mode):
    tgt = write_checkpoint(tmp_path / "t", TARGET)
    dft = write_checkpoint(tmp_path / "d", draft_spec)
    alone = convert_pair(str(dft), tmp_path / "alone", outtype="f32", quant=None)
    res = convert_pair(str(tgt), tmp_path / "pair", draft=str(dft), outtype="f32", quant=None, draft_quant=None)
    with _ffi.Model(res.target_path, vocab_only=True) as t, _ffi.Model(res.draft_path, vocab_only=True) as d, \
            _ffi.Model(alone.target_path, vocab_only=True) as a:
        check_compatible(VocabInfo.of(t), VocabInfo.of(d))
        assert d.n_vocab == t.n_vocab == a.n_vocab + TARGET.extra_rows
        n_in = a.n_vocab
    toks = prompt_tokens(res.target_path)
    before, after = draft_logits(alone.target_path, toks), draft_logits(res.draft_path, toks)
    # real rows keep their logits; the new rows never are the (first) maximum
    np.testing.assert_allclose(after[:, :n_in], before, rtol=0, atol=1e-5)
    assert (after.argmax(1) < n_in).all()
    pad = after[:, n_in:]
    if mode == "bias":
        assert (pad < -1e8).all()
    else:  # an exact copy of one real row: ties it, and argmax takes the lower id
        assert np.all(pad == pad[:, :1]) and np.all(pad[:, 0] <= after[:, :n_in].max(1))
        assert np.any(np.isclose(after[:, :n_in], pad[:, :1], rtol=0, atol=0), axis=1).all()


def test_trimmed_rows(tmp_path):
    tgt = write_checkpoint(tmp_path / "t", TARGET)
    dft_spec = HFSpec(arch="Qwen2ForCausalLM", n_layer=1, extra_rows=TARGET.extra_rows + 40, seed=14)
    dft = write_checkpoint(tmp_path / "d", dft_spec)
    alone = convert_pair(str(dft), tmp_path / "alone", outtype="f32", quant=None)
    res = convert_pair(str(tgt), tmp_path / "pair", draft=str(dft), outtype="f32", quant=None, draft_quant=None)
    with _ffi.Model(res.target_path, vocab_only=True) as t, _ffi.Model(res.draft_path, vocab_only=True) as d:
        check_compatible(VocabInfo.of(t), VocabInfo.of(d))
        assert d.n_vocab == t.n_vocab
        n = t.n_vocab
    toks = prompt_tokens(res.target_path)
    np.testing.assert_allclose(draft_logits(res.draft_path, toks), draft_logits(alone.target_path, toks)[:, :n],
                               rtol=0, atol=1e-5)


def test_different_vocabulary_refused(tmp_path):
    tgt = write_checkpoint(tmp_path / "t", TARGET)
    dft = write_checkpoint(tmp_path / "d", HFSpec(arch="Qwen2ForCausalLM", n_layer=1, corpus=OTHER_CORPUS))
    with pytest.raises(IncompatibleDraftError) as e:
        convert_pair(str(tgt), tmp_path / "pair", draft=str(dft), quant=None, draft_quant=None)
    msg = str(e.value)
    assert "differs from the target's at token" in msg and "target '" in msg and "draft '" in msg
    assert not (tmp_path / "pair").exists() or not any((tmp_path / "pair").iterdir())


def test_engine_speculates_on_converted_pair(tmp_path):
    tgt = write_checkpoint(tmp_path / "t", TARGET)
    dft = write_checkpoint(tmp_path / "d", HFSpec(arch="Qwen2ForCausalLM", n_layer=1, tied=True, seed=15))
    res = convert_pair(str(tgt), tmp_path / "pair", draft=str(dft), quant="Q8_0", draft_quant="Q8_0")
    s = GenerationSettings(n_predict=24, draft_max=4)
    with Engine(res.target_path, res.draft_path, ctx=256, threads=2) as eng:
        prompt = eng.tokenize("The quick brown fox", add_special=True)
        spec = eng.session().generate(prompt, s, speculative=True).run()
        base = eng.session().generate(prompt, s, speculative=False).run()
    assert spec.stats.n_drafted > 0
    assert spec.tokens == base.tokens and len(base.tokens) == 24
