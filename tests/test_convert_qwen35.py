"""Qwen3.5/3.6 checkpoints (llama.cpp `qwen35`) through `specq convert`: llama.cpp loads the file, its logits
match an independent numpy forward over the safetensors, every key and tensor equals what llama.cpp's own
converter writes (derived here from the checkpoint with formulas of the test's own), MTP blocks are kept or
dropped, and a converted pair runs through `specq bench` with the target's own output."""

from __future__ import annotations

import json
import tomllib

import gguf
import numpy as np
import pytest
from typer.testing import CliRunner

from hfmodels import read_safetensors, to_bf16_bits
from hfqwen35 import Qwen35Spec, make_tokenizer, reference_logits, write_checkpoint
from specq.cli.main import app
from specq.convert.pipeline import convert_pair
from specq.errors import ConversionError
from specq.native.llama import ffi as _ffi

PROMPT = "def fibonacci(n):\n    return n  # 你好，世界 🙂 The quick brown fox jumps over the lazy dog."

CASES = {
    # 3 linear + 1 full layer, fewer key than value heads, an MTP block, partial rotary with explicit sections
    "hybrid-f32": Qwen35Spec(dtype="F32"),
    # as Qwen publishes it: BF16 (norms + 1 and A = -exp(A_log) rounded back to BF16 put the logits ~3e-2 off)
    "hybrid-bf16": Qwen35Spec(dtype="BF16"),
    # layer_types that differ from the interval (llama.cpp must follow the recurrent_layers key), default
    # rotary sections, tied embeddings, F16
    "pattern-f16-tied": Qwen35Spec(dtype="F16", linear=(True, False, True, False), sections=None, tied=True,
                                   seed=1),
    # the text part of Qwen3_5ForConditionalGeneration, equal key/value heads, no layer_types
    "multimodal-f32": Qwen35Spec(dtype="F32", multimodal=True, v_heads=2, layer_types=False, n_layer=8, seed=2),
    # qwen35moe: fused [experts, 2 * n_ff, n_embd] gate_up tensors split in two, a gated shared expert
    "moe-f32": Qwen35Spec(dtype="F32", n_expert=4, seed=3),
    "moe-multimodal-f32": Qwen35Spec(dtype="F32", n_expert=4, multimodal=True, mtp=False, seed=4),
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
        tokens = m.tokenize(PROMPT, add_special=False, parse_special=False)[:28]
    assert len(tokens) >= 20
    got = llama_logits(res.target_path, tokens)
    ref = reference_logits(src, spec, tokens)
    assert got.shape == ref.shape
    # llama.cpp keeps the KV cache in F16; the recurrent state is F32
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < 2e-3, f"{case}: max relative logit error {err:.2e}"
    assert (got.argmax(1) == ref.argmax(1)).mean() > 0.9


# ---- keys and tensors, derived independently ------------------------------------------------------
def _f32(x: np.ndarray) -> np.ndarray:
    """Checkpoint values (exact in float64) as float32: what transformers computes the transforms from."""
    return x.astype(np.float32)


def _tiled(x: np.ndarray, k_heads: int, head: int, axis: int = 0) -> np.ndarray:
    """Value heads grouped by key head [k0v0, k0v1, k1v0, ...] -> tiled [k0v0, k1v0, k0v1, ...] along axis."""
    x = np.moveaxis(x, axis, 0)
    n = x.shape[0]
    y = x.reshape((k_heads, n // (k_heads * head), head) + x.shape[1:]).swapaxes(0, 1).reshape(x.shape)
    return np.moveaxis(y, 0, axis)


def expected_tensors(w: dict[str, np.ndarray], spec: Qwen35Spec) -> dict[str, tuple[np.ndarray, str]]:
    """GGUF name -> (values, 'src' (the checkpoint's dtype) or 'f32') for a checkpoint written in its own dtype.
    Transformed values are computed in float32 from the checkpoint's values, as transformers does
    (`1.0 + weight.float()`, `-exp(A_log.float())`) and as llama.cpp's converter writes them from BF16."""
    out: dict[str, tuple[np.ndarray, str]] = {}
    nk, dv = spec.k_heads, spec.lin_dim
    key = nk * dv

    def plus1(x):
        return _f32(x) + np.float32(1.0), "f32"

    def common(b: str, p: str):
        out[b + "attn_norm.weight"] = plus1(w[p + "input_layernorm.weight"])
        out[b + "post_attention_norm.weight"] = plus1(w[p + "post_attention_layernorm.weight"])
        for g, h in (("gate", "gate"), ("up", "up"), ("down", "down")):
            out[b + f"ffn_{g}.weight"] = (w[p + f"mlp.{h}_proj.weight"], "src")

    def attention(b: str, p: str):
        for x in "qkv":
            out[b + f"attn_{x}.weight"] = (w[p + f"self_attn.{x}_proj.weight"], "src")
        out[b + "attn_output.weight"] = (w[p + "self_attn.o_proj.weight"], "src")
        out[b + "attn_q_norm.weight"] = plus1(w[p + "self_attn.q_norm.weight"])
        out[b + "attn_k_norm.weight"] = plus1(w[p + "self_attn.k_norm.weight"])

    out["token_embd.weight"] = (w["model.embed_tokens.weight"], "src")
    out["output.weight"] = (w["lm_head.weight"], "src")
    out["output_norm.weight"] = plus1(w["model.norm.weight"])
    for i in range(spec.n_layer):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        common(b, p)
        if not spec.is_linear(i):
            attention(b, p)
            continue
        a = p + "linear_attn."
        qkv = w[a + "in_proj_qkv.weight"]
        out[b + "attn_qkv.weight"] = (np.concatenate([qkv[:2 * key], _tiled(qkv[2 * key:], nk, dv)]), "src")
        out[b + "attn_gate.weight"] = (_tiled(w[a + "in_proj_z.weight"], nk, dv), "src")
        out[b + "ssm_beta.weight"] = (_tiled(w[a + "in_proj_b.weight"], nk, 1), "src")
        out[b + "ssm_alpha.weight"] = (_tiled(w[a + "in_proj_a.weight"], nk, 1), "src")
        conv = w[a + "conv1d.weight"][:, 0, :]
        out[b + "ssm_conv1d.weight"] = (np.concatenate([conv[:2 * key], _tiled(conv[2 * key:], nk, dv)]), "f32")
        # -exp(A_log) of the checkpoint's (exact) values, rounded once to float32, as torch's float32 exp gives it
        out[b + "ssm_a"] = (_tiled(_f32(-np.exp(w[a + "A_log"])), nk, 1), "f32")
        out[b + "ssm_dt.bias"] = (_tiled(w[a + "dt_bias"], nk, 1), "f32")
        out[b + "ssm_norm.weight"] = (w[a + "norm.weight"], "f32")  # the gated norm multiplies by w itself
        out[b + "ssm_out.weight"] = (_tiled(w[a + "out_proj.weight"], nk, dv, axis=1), "src")
    if spec.mtp:
        b, p = f"blk.{spec.n_layer}.", "mtp.layers.0."
        common(b, p)
        attention(b, p)
        out[b + "nextn.eh_proj.weight"] = (w["mtp.fc.weight"], "src")
        out[b + "nextn.enorm.weight"] = plus1(w["mtp.pre_fc_norm_embedding.weight"])
        out[b + "nextn.hnorm.weight"] = plus1(w["mtp.pre_fc_norm_hidden.weight"])
        out[b + "nextn.shared_head_norm.weight"] = plus1(w["mtp.norm.weight"])
    return out


def read_gguf(path):
    r = gguf.GGUFReader(path)
    return r, {t.name: t for t in r.tensors}


def assert_tensor(t, values: np.ndarray, kind: str, dtype: str, name: str) -> None:
    """The GGUF tensor holds `values`: in the checkpoint's dtype ('src', bit for bit) or F32 (exactly)."""
    data = np.asarray(t.data)
    if kind == "src" and dtype == "BF16":
        assert t.tensor_type == gguf.GGMLQuantizationType.BF16, name
        assert np.array_equal(data.view(np.uint16).reshape(values.shape), to_bf16_bits(values)), name
    elif kind == "src" and dtype == "F16":
        assert t.tensor_type == gguf.GGMLQuantizationType.F16, name
        assert np.array_equal(data.reshape(values.shape), values.astype(np.float16)), name
    else:
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, name
        assert np.array_equal(data.reshape(values.shape), values.astype(np.float32)), name


@pytest.mark.parametrize("dtype", ["BF16", "F16"])
def test_keys_and_tensors_equal_llama_cpp_conversion(tmp_path, dtype):
    spec = Qwen35Spec(seed=5, dtype=dtype)
    src = write_checkpoint(tmp_path / "hf", spec)
    res = convert_pair(str(src), tmp_path / "out", quant=None)  # the source dtype stays
    r, got = read_gguf(res.target_path)
    f = r.fields
    arch = "qwen35"
    want_keys = {
        "general.architecture": arch, f"{arch}.block_count": spec.n_layer + 1, f"{arch}.nextn_predict_layers": 1,
        f"{arch}.context_length": 4096, f"{arch}.embedding_length": spec.n_embd,
        f"{arch}.feed_forward_length": spec.n_ff, f"{arch}.attention.head_count": spec.n_head,
        f"{arch}.attention.head_count_kv": spec.n_head_kv, f"{arch}.attention.key_length": spec.head_dim,
        f"{arch}.attention.value_length": spec.head_dim, f"{arch}.ssm.conv_kernel": spec.conv,
        f"{arch}.ssm.state_size": spec.lin_dim, f"{arch}.ssm.group_count": spec.k_heads,
        f"{arch}.ssm.time_step_rank": spec.v_heads, f"{arch}.ssm.inner_size": spec.lin_dim * spec.v_heads,
        f"{arch}.full_attention_interval": spec.interval, f"{arch}.rope.dimension_count": spec.head_dim // 4,
        f"{arch}.rope.dimension_sections": [2, 1, 1, 0],
        f"{arch}.attention.recurrent_layers": [True, True, True, False, False],
        "tokenizer.ggml.pre": "qwen35", "tokenizer.ggml.model": "gpt2",
    }
    for k, v in want_keys.items():
        assert k in f, k
        assert f[k].contents() == v, k
    assert f[f"{arch}.rope.freq_base"].contents() == pytest.approx(spec.rope_theta)
    assert f[f"{arch}.attention.layer_norm_rms_epsilon"].contents() == pytest.approx(spec.eps)

    want = expected_tensors(read_safetensors(src / "model.safetensors"), spec)
    assert set(got) == set(want)
    for name, (values, kind) in want.items():
        assert_tensor(got[name], values, kind, dtype, name)

    man = tomllib.loads(res.manifest_path.read_text(encoding="utf-8"))["target"]
    mtp_bytes = sum(int(np.prod(v.shape)) * (2 if kind == "src" else 4)
                    for n, (v, kind) in want.items() if n.startswith(f"blk.{spec.n_layer}."))
    assert man["mtp_layers"] == 1 and man["mtp_bytes"] == res.mtp_bytes == mtp_bytes > 0


@pytest.mark.parametrize("how", ["flag", "absent"])
def test_without_mtp(tmp_path, how):
    """--no-mtp drops the blocks; a checkpoint without them converts although config.json announces one."""
    spec = Qwen35Spec(dtype="F32", mtp=how == "flag", seed=6)
    src = write_checkpoint(tmp_path / "hf", spec)
    assert json.loads((src / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    res = convert_pair(str(src), tmp_path / "out", quant=None, mtp=False if how == "flag" else True)
    r, got = read_gguf(res.target_path)
    assert r.fields["qwen35.block_count"].contents() == spec.n_layer
    assert "qwen35.nextn_predict_layers" not in r.fields
    assert not [n for n in got if n.startswith(f"blk.{spec.n_layer}.")]
    assert res.mtp_layers == 0 and res.mtp_bytes == 0
    # still the same model: llama.cpp runs it and matches the reference
    with _ffi.Model(res.target_path, vocab_only=True) as m:
        tokens = m.tokenize(PROMPT, add_special=False, parse_special=False)[:16]
    ref = reference_logits(src, spec, tokens)
    assert np.abs(llama_logits(res.target_path, tokens) - ref).max() / np.abs(ref).max() < 2e-3


def test_cli_reports_mtp_and_drops_it_on_request(tmp_path):
    src = write_checkpoint(tmp_path / "hf", Qwen35Spec(dtype="F32", seed=7))
    runner = CliRunner()
    r = runner.invoke(app, ["convert", str(src), "--out", str(tmp_path / "a"), "--quant", "none", "--quiet"])
    assert r.exit_code == 0, r.output
    assert "mtp:    1 block(s)" in r.stdout and "--no-mtp" in r.stdout
    r = runner.invoke(app, ["convert", str(src), "--out", str(tmp_path / "b"), "--quant", "none", "--quiet",
                            "--no-mtp"])
    assert r.exit_code == 0, r.output
    assert "mtp:" not in r.stdout
    a, b = (next((tmp_path / d).glob("*.gguf")).stat().st_size for d in "ab")
    assert a > b


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    src = write_checkpoint(tmp_path / "hf", Qwen35Spec(n_layer=4, seed=8))
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["Qwen3NextForCausalLM"]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError) as e:
        convert_pair(str(src), tmp_path / "out", quant=None)
    msg = str(e.value)
    assert "unsupported architecture Qwen3NextForCausalLM" in msg
    for name in ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
                 "Qwen3ForCausalLM", "LlamaForCausalLM"):
        assert name in msg


def test_mismatched_linear_shape_is_refused_before_writing(tmp_path):
    src = write_checkpoint(tmp_path / "hf", Qwen35Spec(seed=9))
    cfg = json.loads((src / "config.json").read_text())
    cfg["linear_num_value_heads"] = 8  # the tensors were written for 4
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match="in_proj_qkv.weight has shape"):
        convert_pair(str(src), tmp_path / "out", quant=None)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


# ---- the pair through specq bench ------------------------------------------------------------------
def test_converted_pair_benches_identical_to_the_target(tmp_path):
    tok = make_tokenizer(400)
    target = write_checkpoint(tmp_path / "target", Qwen35Spec(n_layer=8, seed=11), tokenizer=tok)
    draft = write_checkpoint(tmp_path / "draft", Qwen35Spec(n_layer=4, n_embd=32, n_ff=64, head_dim=16, tied=True,
                                                              mtp=False, seed=12), tokenizer=tok)
    res = convert_pair(str(target), tmp_path / "pair", draft=str(draft), quant="Q8_0", draft_quant="Q8_0")
    assert res.mtp_layers == 1 and res.draft_path is not None
    # a fixed draft length: on models this tiny, auto rightly finds that drafting does not pay
    r = CliRunner().invoke(app, ["bench", "--pair", str(tmp_path / "pair"), "--prompt", "def fibonacci(n):",
                                 "--prompt", "The quick brown fox", "--n-predict", "24", "--draft-max", "4",
                                 "--ctx", "256", "--json", "-"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["summary"]["identical_output"] is True
    spec_runs = [x for x in doc["runs"] if x["mode"] == "speculative"]
    base_runs = [x for x in doc["runs"] if x["mode"] == "baseline"]
    assert spec_runs and all(x["n_drafted"] > 0 for x in spec_runs)
    for s, b in zip(spec_runs, base_runs):
        assert s["tokens"] == b["tokens"] and s["n_generated"] == b["n_generated"] > 0
    assert len({tuple(x["tokens"]) for x in base_runs}) == 2  # the two prompts give different, real output


def _mapped_kib(path) -> int:
    """Resident KiB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps", encoding="utf-8"):
        if line[0] in "0123456789abcdef" and " " in line and "-" in line.split()[0]:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_reordered_rows_stream_and_leave_no_pages_mapped(tmp_path):
    """Value-head reordering reads rows out of order; the pages it touched are released afterwards (this 16 MiB
    tensor read in 32 strided runs kept 1 MiB mapped, by fault-around, before the whole range was dropped)."""
    from hfmodels import write_safetensors
    from specq.convert.checkpoint import MappedFiles, read_header

    rows, cols, head = 4096, 1024, 128
    x = np.arange(rows, dtype=np.float32)[:, None] + np.zeros((1, cols), np.float32)
    write_safetensors(tmp_path / "t.safetensors", {"w": x}, "F32")
    ref = read_header(tmp_path / "t.safetensors")["w"]
    runs = [((k * 2 + j) * head, (k * 2 + j + 1) * head) for j in range(2) for k in range(16)]
    with MappedFiles() as maps:
        got = np.concatenate([c for c in maps.row_runs(ref, runs, chunk_bytes=head * cols * 4 // 2)])
        assert _mapped_kib(tmp_path / "t.safetensors") < 256
    want = np.concatenate([np.arange(a, b) for a, b in runs]).astype(np.float32)
    assert np.array_equal(got[:, 0], want) and np.array_equal(got[:, -1], want)


def test_moe_keys_and_expert_tensors(tmp_path):
    spec = Qwen35Spec(n_expert=4, seed=13)
    src = write_checkpoint(tmp_path / "hf", spec)
    res = convert_pair(str(src), tmp_path / "out", quant=None)
    r, got = read_gguf(res.target_path)
    f = r.fields
    assert f["general.architecture"].contents() == "qwen35moe"
    assert f["qwen35moe.expert_count"].contents() == 4 and f["qwen35moe.expert_used_count"].contents() == 2
    assert f["qwen35moe.expert_feed_forward_length"].contents() == spec.n_ff_exp
    assert f["qwen35moe.expert_shared_feed_forward_length"].contents() == spec.n_ff_shexp
    w = read_safetensors(src / "model.safetensors")
    fe = spec.n_ff_exp
    for i in (0, spec.n_layer):  # a trunk layer and the MTP block
        p = f"model.layers.{i}.mlp." if i < spec.n_layer else "mtp.layers.0.mlp."
        gu = w[p + "experts.gate_up_proj"]
        want = {"ffn_gate_exps.weight": (gu[:, :fe], "src"), "ffn_up_exps.weight": (gu[:, fe:], "src"),
                "ffn_down_exps.weight": (w[p + "experts.down_proj"], "src"),
                "ffn_gate_inp.weight": (w[p + "gate.weight"], "f32"),
                "ffn_gate_inp_shexp.weight": (w[p + "shared_expert_gate.weight"], "f32"),
                "ffn_down_shexp.weight": (w[p + "shared_expert.down_proj.weight"], "src")}
        for name, (values, kind) in want.items():
            assert_tensor(got[f"blk.{i}.{name}"], values, kind, spec.dtype, name)
    assert not [n for n in got if ".ffn_gate.weight" in n or ".ffn_up.weight" in n]


def test_moe_per_expert_tensors_are_refused(tmp_path):
    from hfmodels import write_safetensors

    spec = Qwen35Spec(n_expert=4, seed=14, mtp=False)
    src = write_checkpoint(tmp_path / "hf", spec)
    w = {k: v.astype(np.float32) for k, v in read_safetensors(src / "model.safetensors").items()}
    gu = w.pop("model.layers.0.mlp.experts.gate_up_proj")
    for e in range(spec.n_expert):
        w[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] = gu[e, :spec.n_ff_exp]
    write_safetensors(src / "model.safetensors", w, "BF16")
    with pytest.raises(ConversionError, match="stores its experts one tensor each"):
        convert_pair(str(src), tmp_path / "out", quant=None)


TOKENIZER_TEXTS = [
    "Hello world! The fox's 3.14159 numbers: 2024-01-02, it's what they'll've done.",
    "今天天气很好，我们去公园散步。你好，世界。",
    "def fibonacci(n):\n    if n < 2:\n        return n\n\treturn fib(n - 1)  # code\n\n",
    "emoji 🙂🚀 👩‍💻 👍🏿 café naïve Äpfel",
    "नमस्ते दुनिया, नमस्कार ภาษาไทย ภาษา",  # combining marks (\p{M}): where Qwen3.5's pre-tokenizer differs from Qwen2's
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nhello<|im_end|>",
]


def test_tiny_tokenizer_ids_equal_hugging_face(tmp_path):
    """A tiny vocabulary with Qwen3.5's pre-tokenizer (letters with marks, single digits, NFC): llama.cpp's
    `qwen35` pre-tokenizer on the converted file gives the `tokenizers` package's ids (the slow test in
    test_convert_qwen35_vocab.py does the same with the real 248k vocabulary)."""
    from tokenizers import Tokenizer

    from tinymodels import CORPUS

    tok = make_tokenizer(600, CORPUS + TOKENIZER_TEXTS[4] * 3)  # merges across letters and their marks
    src = write_checkpoint(tmp_path / "hf", Qwen35Spec(n_layer=4, mtp=False, seed=15), tokenizer=tok)
    res = convert_pair(str(src), tmp_path / "out", quant=None)
    assert gguf.GGUFReader(res.target_path).fields["tokenizer.ggml.pre"].contents() == "qwen35"
    hf = Tokenizer.from_file(str(src / "tokenizer.json"))
    with _ffi.Model(res.target_path, vocab_only=True) as m:
        for text in TOKENIZER_TEXTS:
            assert m.tokenize(text, add_special=False, parse_special=True) == \
                hf.encode(text, add_special_tokens=False).ids, text
