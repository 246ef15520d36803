"""Gemma 3 checkpoints -> llama.cpp `gemma3`: metadata and tensors equal independently derived values, logits
match a numpy forward pass over the safetensors (prompts longer than the sliding window), token ids match
SentencePiece, and a converted pair speculates with the target's output."""

from __future__ import annotations

import json
from dataclasses import replace

import gguf
import numpy as np
import pytest
import sentencepiece as spm
from typer.testing import CliRunner

from hfgemma3 import USER_SYMBOLS, GemmaSpec, reference_logits, text_prefix, train_gemma_spm, write_gemma3_checkpoint
from hfmodels import read_safetensors, to_bf16_bits
from specq.cli.main import app
from specq.convert.pipeline import convert_pair
from specq.errors import ConversionError, IncompatibleDraftError
from specq.native.llama import ffi as _ffi

CASES = {
    "causal": GemmaSpec(),
    "multimodal": GemmaSpec(multimodal=True, image_token=True, extra_rows=4, seed=1),
    "multimodal-v5-softcap": GemmaSpec(multimodal=True, new_layout=True, softcap=30.0, seed=2),
    "two-layers-unscaled": GemmaSpec(n_layer=2, layer_types=("sliding_attention", "full_attention"),
                                     rope_factor=None, seed=3),
}
PROMPT = ("The quick brown fox jumps over the lazy dog. def fibonacci(n): return n\n"
          "今天天气很好 🙂 12345")
TEXTS = {
    "english": "The weather is nice today, and the garden is full of flowers.",
    "chinese": "今天天气很好，我们去公园散步。世界你好。",
    "code": "def f(x):\n    return x * 12345 + 67  # code\n\tif (a && b) { return x->y[3]; }\n",
    "emoji": "emoji 🙂🚀 👩‍💻🧑🏽‍🚀 👍🏿 and numbers 3.14159",
    "chat": "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\nParis.",
    "spaces": "  two  spaces   and\ttab\n\nnewlines",
}
# What llama.cpp's gemma3 loader creates for each layer (src/models/gemma3.cpp), with the HF tensor it comes from.
LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "post_ffw_norm": "post_feedforward_layernorm",
}


@pytest.fixture(scope="module")
def proto() -> bytes:
    return train_gemma_spm()


def fields(path) -> dict:
    r = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items()}


def llama_logits(path, tokens: list[int]) -> np.ndarray:
    with _ffi.Model(path) as m, _ffi.Context(m, 128, 2, n_outputs_max=len(tokens)) as c:
        c.decode(tokens, 0, logits="all")
        return np.array(c.logits(len(tokens)), dtype=np.float64)


@pytest.mark.parametrize("case", list(CASES))
def test_metadata_and_tensors(tmp_path, proto, case):
    spec = CASES[case]
    src = write_gemma3_checkpoint(tmp_path / "hf", spec, proto)
    res = convert_pair(str(src), tmp_path / "out", quant=None)  # BF16 source -> BF16 file
    f = fields(res.target_path)
    n_pieces = spm.SentencePieceProcessor(model_proto=proto).vocab_size()
    n_rows = n_pieces + spec.extra_rows
    want = {"general.architecture": "gemma3", "gemma3.context_length": 4096, "gemma3.embedding_length": 64,
            "gemma3.block_count": spec.n_layer, "gemma3.feed_forward_length": 128,
            "gemma3.attention.head_count": 4, "gemma3.attention.head_count_kv": 2,
            "gemma3.attention.key_length": 32, "gemma3.attention.value_length": 32,
            "gemma3.rope.freq_base": 1e6, "gemma3.rope.freq_base_swa": 1e4,
            "gemma3.attention.sliding_window": 8, "gemma3.vocab_size": n_rows}
    for k, v in want.items():
        assert f[k] == pytest.approx(v), k
    assert f["gemma3.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    if spec.rope_factor:
        assert f["gemma3.rope.scaling.type"] == "linear" and f["gemma3.rope.scaling.factor"] == 8.0
    else:
        assert "gemma3.rope.scaling.type" not in f and "gemma3.rope.scaling.factor" not in f
    if spec.layer_types is None:  # the 5:1 pattern llama.cpp assumes: no key, as llama.cpp's converter writes
        assert "gemma3.attention.sliding_window_pattern" not in f
    else:
        assert f["gemma3.attention.sliding_window_pattern"] == [t == "sliding_attention" for t in spec.layer_types]
    tokens, types = f["tokenizer.ggml.tokens"], f["tokenizer.ggml.token_type"]
    assert len(tokens) == n_rows
    if spec.image_token:  # added_tokens.json's id past the pieces, special in tokenizer_config
        assert tokens[n_pieces] == "<image_soft_token>" and types[n_pieces] == gguf.TokenType.CONTROL
    pad = n_pieces + spec.image_token
    assert tokens[pad:] == [f"[PAD{i}]" for i in range(pad, n_rows)]
    assert types[pad:] == [gguf.TokenType.UNUSED] * (n_rows - pad)
    assert f.get("gemma3.final_logit_softcapping") == (pytest.approx(spec.softcap) if spec.softcap else None)

    hf = read_safetensors(src / "model.safetensors")
    p0 = text_prefix(spec)
    expect = {"token_embd.weight": p0 + "embed_tokens.weight", "output_norm.weight": p0 + "norm.weight"}
    for i in range(spec.n_layer):
        expect |= {f"blk.{i}.{g}.weight": f"{p0}layers.{i}.{h}.weight" for g, h in LAYER_TENSORS.items()}
    tensors = {t.name: t for t in gguf.GGUFReader(res.target_path).tensors}
    assert set(tensors) == set(expect)  # tied: no output.weight; no vision tower
    for name, hf_name in expect.items():
        t, x = tensors[name], hf[hf_name]
        assert tuple(int(n) for n in reversed(t.shape)) == x.shape, name
        if name.endswith("norm.weight"):  # Gemma's RMSNorm multiplies by 1 + w: stored as w + 1, in float32
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
            assert np.array_equal(np.asarray(t.data), x.astype(np.float32) + np.float32(1)), name
        else:
            assert t.tensor_type == gguf.GGMLQuantizationType.BF16
            got = np.asarray(t.data).view(np.uint16).reshape(x.shape)
            assert np.array_equal(got, to_bf16_bits(x.astype(np.float32))), name


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_reference(tmp_path, proto, case):
    spec = CASES[case]
    src = write_gemma3_checkpoint(tmp_path / "hf", spec, proto)
    res = convert_pair(str(src), tmp_path / "out", outtype="f32", quant=None)
    with _ffi.Model(res.target_path, vocab_only=True) as m:
        tokens = m.tokenize(PROMPT, add_special=True, parse_special=False)
    assert len(tokens) > 2 * spec.sliding_window  # the local layers' window matters
    got = llama_logits(res.target_path, tokens)
    ref = reference_logits(src, spec, tokens)
    # llama.cpp keeps the KV cache in F16: differences of ~1e-3 of the logit scale are expected.
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < 2e-3, f"{case}: max relative logit error {err:.2e}"
    assert (got.argmax(1) == ref.argmax(1)).mean() > 0.9


def test_vocabulary_and_token_ids_match_sentencepiece(tmp_path, proto):
    src = write_gemma3_checkpoint(tmp_path / "hf", GemmaSpec(), proto)
    res = convert_pair(str(src), tmp_path / "out", quant="Q8_0")
    sp = spm.SentencePieceProcessor(model_proto=proto)
    f = fields(res.target_path)
    n = sp.vocab_size()
    added = {sp.piece_to_id(t) for t in ("<pad>", "<eos>", "<bos>", "<unk>", *USER_SYMBOLS)}  # tokenizer_config
    # flagged special, or looking special as llama.cpp's converter decides (<mask>, [@BOS@], <unusedN>)
    control = added - {sp.piece_to_id("<start_of_image>"), sp.piece_to_id("<end_of_image>")}
    assert f["tokenizer.ggml.model"] == "llama" and f["tokenizer.ggml.pre"] == "default"
    assert f["tokenizer.ggml.tokens"] == [sp.id_to_piece(i) for i in range(n)]
    types, scores = f["tokenizer.ggml.token_type"], f["tokenizer.ggml.scores"]
    for i in range(n):
        if i in control:
            want = gguf.TokenType.CONTROL
        elif i in added:
            want = gguf.TokenType.USER_DEFINED
        else:
            want = gguf.TokenType.BYTE if sp.is_byte(i) else gguf.TokenType.NORMAL
        assert types[i] == want, (i, sp.id_to_piece(i))
        assert scores[i] == pytest.approx(-1000.0 if i in added else sp.get_score(i)), i
    assert (f["tokenizer.ggml.bos_token_id"], f["tokenizer.ggml.eos_token_id"], f["tokenizer.ggml.padding_token_id"],
            f["tokenizer.ggml.unknown_token_id"]) == (2, 1, 0, 3)
    assert f["tokenizer.ggml.add_bos_token"] is True and f["tokenizer.ggml.add_eos_token"] is False
    assert f["tokenizer.ggml.add_space_prefix"] is False
    with _ffi.Model(res.target_path, vocab_only=True) as m:
        assert m.add_bos and m.bos == 2 and m.is_eog(1)
        assert m.is_eog(sp.piece_to_id("<end_of_turn>"))  # llama.cpp ends a chat turn on it
        assert "<start_of_turn>" in (m.chat_template() or "")
        for name, text in TEXTS.items():
            ids = m.tokenize(text, add_special=True, parse_special=True)
            assert ids == [2] + sp.encode(text), name
            assert m.detokenize(ids[1:]) == sp.decode(ids[1:]) == text or name == "chat", name
        chat = m.tokenize(TEXTS["chat"], add_special=False, parse_special=True)
        assert chat[0] == sp.piece_to_id("<start_of_turn>") and sp.piece_to_id("<end_of_turn>") in chat


def test_pair_speculates_with_the_targets_output(tmp_path, proto):
    """The converted pair (7-layer target, 2-layer draft, one tokenizer) through `specq bench`."""
    # as Gemma-3-27B and its 1B/270M drafts: the target has rows for <image_soft_token>, the draft ends before it
    tgt = write_gemma3_checkpoint(tmp_path / "t", GemmaSpec(multimodal=True, image_token=True, extra_rows=8,
                                                             embed_scale=0.1, seed=10), proto)
    dft = write_gemma3_checkpoint(tmp_path / "d", replace(CASES["two-layers-unscaled"], image_token=True,
                                                          embed_scale=0.1), proto)
    res = convert_pair(str(tgt), tmp_path / "pair", draft=str(dft), quant="Q8_0", draft_quant="Q8_0")
    with _ffi.Model(res.target_path, vocab_only=True) as t, _ffi.Model(res.draft_path, vocab_only=True) as d:
        n_pieces = spm.SentencePieceProcessor(model_proto=proto).vocab_size()
        assert d.n_vocab == t.n_vocab == n_pieces + 8
    out = tmp_path / "bench.json"
    r = CliRunner().invoke(app, ["bench", "--target", str(res.target_path), "--draft", str(res.draft_path),
                                 "--prompt", "The quick brown fox jumps over the lazy dog.", "--prompt",
                                 "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n",
                                 "--n-predict", 32, "--repeat", 1, "--ctx", 256, "--draft-max", 4, "--threads", 1,
                                 "--json", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    spec_runs = [x for x in doc["runs"] if x["mode"] == "speculative"]
    assert spec_runs and all(x["n_drafted"] > 0 for x in spec_runs)
    assert all(x["n_generated"] == 32 for x in doc["runs"])
    assert len({x["n_prompt"] for x in doc["runs"]}) == 2 and min(x["n_prompt"] for x in doc["runs"]) > 8
    assert doc["summary"]["identical_output"] is True
    for i in (0, 1):  # non-degenerate output: several different tokens
        base = next(x for x in doc["runs"] if x["mode"] == "baseline" and x["prompt_index"] == i)
        assert len(set(base["tokens"])) > 3
    # the target as its own draft: every drafted token is accepted, across the sliding window's edge
    r = CliRunner().invoke(app, ["bench", "--target", str(res.target_path), "--draft", str(res.target_path),
                                 "--prompt", "The quick brown fox jumps over the lazy dog.", "--n-predict", 32,
                                 "--repeat", 1, "--ctx", 256, "--draft-max", 4, "--threads", 1, "--json", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    run = next(x for x in doc["runs"] if x["mode"] == "speculative")
    assert run["n_drafted"] > 0 and run["n_accepted"] == run["n_drafted"]
    assert doc["summary"]["identical_output"] is True


def test_attention_scale_llama_cpp_cannot_express_refused(tmp_path, proto):
    src = write_gemma3_checkpoint(tmp_path / "hf", GemmaSpec(), proto)
    cfg = json.loads((src / "config.json").read_text())
    cfg["query_pre_attn_scalar"] = 16  # n_embd / n_head, which llama.cpp uses only at 62 layers (27B)
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match="query_pre_attn_scalar is 16"):
        convert_pair(str(src), tmp_path / "out", quant=None)
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture_lists_gemma3(tmp_path, proto):
    src = write_gemma3_checkpoint(tmp_path / "hf", GemmaSpec(), proto)
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["Gemma3nForCausalLM"]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match="unsupported architecture Gemma3nForCausalLM") as e:
        convert_pair(str(src), tmp_path / "out", quant=None)
    assert "Gemma3ForCausalLM" in str(e.value) and "Gemma3ForConditionalGeneration" in str(e.value)


@pytest.mark.parametrize("extra_type, allowed", [(gguf.TokenType.CONTROL, True), (gguf.TokenType.USER_DEFINED, True),
                                                 (gguf.TokenType.NORMAL, False)])
def test_target_may_only_add_added_tokens_past_the_drafts_end(extra_type, allowed):
    from specq.convert.align import check_same_vocabulary
    from specq.convert.vocab import Vocab

    def vocab(tokens, types):
        n = len(tokens)
        return Vocab(tokens + ["[PAD9]"], types + [gguf.TokenType.UNUSED], n, "default", None, "x", model="llama",
                     scores=[0.0] * n + [-1000.0])

    pieces = ["<pad>", "a", "b", "ab"]
    normal = [gguf.TokenType.CONTROL] + [gguf.TokenType.NORMAL] * 3
    target = vocab(pieces + ["<image_soft_token>"], normal + [extra_type])
    draft = vocab(pieces, normal)
    if allowed:
        check_same_vocabulary(target, draft)
    else:
        with pytest.raises(IncompatibleDraftError, match="differs from the target's at token 4"):
            check_same_vocabulary(target, draft)
    with pytest.raises(IncompatibleDraftError, match="at token 4"):  # never the other way round
        check_same_vocabulary(draft, target)


def test_27b_config_reads_with_transformers_defaults(tmp_path):
    """google/gemma-3-27b-it's config.json lists only what differs from Gemma3TextConfig's defaults."""
    from specq.convert.arch import read_config

    cfg = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
           "image_token_index": 262144, "mm_tokens_per_image": 256, "torch_dtype": "bfloat16",
           "text_config": {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504,
                           "model_type": "gemma3_text", "num_attention_heads": 32, "num_hidden_layers": 62,
                           "num_key_value_heads": 16, "query_pre_attn_scalar": 168,
                           "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
           "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model", "patch_size": 14}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    s = read_config(tmp_path, "27b")
    assert (s.n_layer, s.n_embd, s.n_head, s.n_head_kv, s.head_dim, s.n_ff) == (62, 5376, 32, 16, 128, 21504)
    assert (s.n_ctx, s.vocab_size, s.tied, s.rms_eps, s.rope_theta) == (131072, 262208, True, 1e-6, 1e6)
    g = s.gemma
    assert (g.sliding_window, g.rope_theta_swa, g.rope_scale_factor) == (1024, 1e4, 8.0)
    assert g.final_logit_softcapping is None
    assert g.default_pattern and sum(not x for x in g.swa_layers) == 10  # layers 5, 11, ..., 59 are global
    cfg["text_config"]["num_hidden_layers"] = 48  # the same attention scale at another depth: not what llama.cpp does
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match="scales attention by 1/sqrt"):
        read_config(tmp_path, "48")
