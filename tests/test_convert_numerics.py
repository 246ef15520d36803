"""Logits from llama.cpp on converted tiny checkpoints match an independent numpy forward pass over the
Hugging Face safetensors (HF rotate-half RoPE, so a wrong Q/K permutation or a missing bias/norm fails)."""

from __future__ import annotations

import numpy as np
import pytest

from hfmodels import TEST_TEXT, HFSpec, reference_logits, write_checkpoint
from specq.convert.pipeline import convert_pair
from specq.native.llama import ffi as _ffi

CASES = {
    "llama": HFSpec(arch="LlamaForCausalLM", pretok="llama3"),
    "llama-tied": HFSpec(arch="LlamaForCausalLM", tied=True, pretok="smollm", seed=1),
    "qwen2-biases": HFSpec(arch="Qwen2ForCausalLM", seed=2),
    "qwen2-tied-f16": HFSpec(arch="Qwen2ForCausalLM", tied=True, dtype="F16", seed=3),
    "qwen3-qknorm": HFSpec(arch="Qwen3ForCausalLM", head_dim=32, seed=4),
    "qwen3-tied": HFSpec(arch="Qwen3ForCausalLM", head_dim=16, tied=True, seed=5),
}


def llama_logits(path, tokens: list[int]) -> np.ndarray:
    with _ffi.Model(path) as m, _ffi.Context(m, 128, 2, n_outputs_max=len(tokens)) as c:
        c.decode(tokens, 0, logits="all")
        return np.array(c.logits(len(tokens)), dtype=np.float64)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_reference(tmp_path, case):
    spec = CASES[case]
    src = write_checkpoint(tmp_path / "hf", spec)
    res = convert_pair(str(src), tmp_path / "out", outtype="f32", quant=None)
    with _ffi.Model(res.target_path, vocab_only=True) as m:
        tokens = m.tokenize(TEST_TEXT, add_special=False, parse_special=False)[:24]
    got = llama_logits(res.target_path, tokens)
    ref = reference_logits(src, spec, tokens)
    assert got.shape == ref.shape
    # llama.cpp keeps the KV cache in F16: differences of ~1e-3 of the logit scale are expected.
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < 2e-3, f"{case}: max relative logit error {err:.2e}"
    assert (got.argmax(1) == ref.argmax(1)).mean() > 0.9


def test_bf16_stays_bf16_bit_exact(tmp_path):
    """A BF16 checkpoint written as BF16 carries the same bits (no round trip through another type)."""
    import gguf

    from hfmodels import read_safetensors, to_bf16_bits

    spec = HFSpec(arch="Qwen2ForCausalLM", seed=7)
    src = write_checkpoint(tmp_path / "hf", spec)
    res = convert_pair(str(src), tmp_path / "out", quant=None)  # default outtype: the source dtype
    assert res.target_path.name.endswith("-BF16.gguf")
    r = gguf.GGUFReader(res.target_path)
    t = {x.name: x for x in r.tensors}
    up = t["blk.1.ffn_up.weight"]
    assert up.tensor_type == gguf.GGMLQuantizationType.BF16
    want = to_bf16_bits(read_safetensors(src / "model.safetensors")["model.layers.1.mlp.up_proj.weight"].astype(np.float32))
    assert np.array_equal(np.asarray(up.data).view(np.uint16).reshape(want.shape), want)
    assert t["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32  # 1-D tensors as upstream
