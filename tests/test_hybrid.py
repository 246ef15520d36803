"""Recurrent targets (memory that cannot remove part of a sequence): checkpoints make speculation exact."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from specq.native.runtime.engine import Engine
from specq.native.core.settings import GenerationSettings
from tinymodels import SPECIALS, vocab

PROMPTS = ["def fibonacci(n):", "The quick brown fox"]


def write_tiny_mamba(path: Path, seed: int, n_layer: int = 2, n_embd: int = 32, noise_from: tuple[int, float] | None = None,
                     n_merges: int = 200) -> Path:
    """A tiny Mamba (llama.cpp: recurrent memory) with the tiny llama models' vocabulary."""
    tokens, merges = vocab(n_merges)
    n_vocab = len(tokens)
    d_inner, d_state, d_conv, dt_rank = 2 * n_embd, 8, 4, 4

    def weights(s):
        rng = np.random.default_rng(s)

        def mat(*shape, scale=1.0):
            return (rng.standard_normal(shape) * scale).astype(np.float32)

        w = {"token_embd.weight": mat(n_vocab, n_embd), "output_norm.weight": np.ones(n_embd, np.float32),
             "output.weight": mat(n_vocab, n_embd, scale=2.0 / np.sqrt(n_embd))}
        for i in range(n_layer):
            b = f"blk.{i}."
            w[b + "attn_norm.weight"] = np.ones(n_embd, np.float32)
            w[b + "ssm_in.weight"] = mat(2 * d_inner, n_embd, scale=1 / np.sqrt(n_embd))
            w[b + "ssm_conv1d.weight"] = mat(d_inner, d_conv, scale=0.5)
            w[b + "ssm_conv1d.bias"] = np.zeros(d_inner, np.float32)
            w[b + "ssm_x.weight"] = mat(dt_rank + 2 * d_state, d_inner, scale=1 / np.sqrt(d_inner))
            w[b + "ssm_dt.weight"] = mat(d_inner, dt_rank, scale=0.5)
            w[b + "ssm_dt.bias"] = np.full(d_inner, -2.0, np.float32)
            # A = −exp(A_log) as convert_hf_to_gguf stores it: negative, so the state decays
            w[b + "ssm_a"] = -np.tile(np.arange(1, d_state + 1, dtype=np.float32), (d_inner, 1))
            w[b + "ssm_d"] = np.ones(d_inner, np.float32)
            w[b + "ssm_out.weight"] = mat(n_embd, d_inner, scale=1 / np.sqrt(d_inner))
        return w

    w = weights(seed)
    if noise_from is not None:
        base, scale = noise_from
        noise = w
        w = {k: (v + scale * noise[k] if v.ndim == 2 and k.endswith("weight") else v)
             for k, v in weights(base).items()}
    arch = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MAMBA]
    wr = gguf.GGUFWriter(str(path), arch)
    wr.add_name(f"specq-tiny-mamba-{seed}")
    wr.add_context_length(2048)
    wr.add_embedding_length(n_embd)
    wr.add_block_count(n_layer)
    wr.add_feed_forward_length(0)
    wr.add_head_count(0)
    wr.add_ssm_conv_kernel(d_conv)
    wr.add_ssm_inner_size(d_inner)
    wr.add_ssm_state_size(d_state)
    wr.add_ssm_time_step_rank(dt_rank)
    wr.add_layer_norm_rms_eps(1e-5)
    wr.add_file_type(gguf.LlamaFileType.ALL_F32)
    wr.add_vocab_size(n_vocab)
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("default")
    wr.add_token_list(tokens)
    wr.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (n_vocab - len(SPECIALS)))
    wr.add_token_merges(merges)
    wr.add_bos_token_id(1)
    wr.add_eos_token_id(0)
    wr.add_add_bos_token(False)
    for name, arr in w.items():
        wr.add_tensor(name, arr)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


@pytest.fixture(scope="module")
def mamba_target(models_dir):
    return write_tiny_mamba(models_dir / "mamba_target.gguf", seed=21)


@pytest.fixture(scope="module")
def mamba_close(models_dir):
    return write_tiny_mamba(models_dir / "mamba_close.gguf", seed=22, noise_from=(21, 0.15))


def generate(e, prompt, speculative, **kw):
    return e.session().generate(e.tokenize(prompt), GenerationSettings(**kw), speculative=speculative).run()


def test_recurrent_target_with_llama_draft_equals_target_alone(mamba_target, tiny_target):
    with Engine(mamba_target, tiny_target, ctx=256, threads=1) as e:
        assert e.target.is_recurrent_or_hybrid
        restores = 0
        for p in PROMPTS:
            base = generate(e, p, False, n_predict=40)
            assert len(set(base.tokens)) > 3
            for k in (2, 5):
                g = generate(e, p, True, n_predict=40, draft_max=k)
                assert g.tokens == base.tokens, (p, k)
                assert g.stats.n_drafted > 0
                restores += g.stats.n_restores
        assert restores > 0  # partial acceptance really went through a checkpoint restore


def test_recurrent_target_and_recurrent_draft(mamba_target, mamba_close):
    with Engine(mamba_target, mamba_close, ctx=256, threads=1) as e:
        assert e.draft.is_recurrent_or_hybrid
        for p in PROMPTS:
            base = generate(e, p, False, n_predict=40)
            g = generate(e, p, True, n_predict=40, draft_max=4)
            assert g.tokens == base.tokens, p
            assert 0 < g.stats.n_accepted < g.stats.n_drafted  # partial acceptance, on both memories
            assert g.stats.n_restores > 0


def test_recurrent_target_adaptive_and_rejection_run(mamba_target, mamba_close):
    with Engine(mamba_target, mamba_close, ctx=256, threads=1) as e:
        base = generate(e, PROMPTS[0], False, n_predict=32)
        g = generate(e, PROMPTS[0], True, n_predict=32, draft_max="auto")
        assert g.tokens == base.tokens
        r = generate(e, PROMPTS[0], True, n_predict=32, temp=0.8, seed=3)
        assert r.stats.accept_mode == "rejection" and r.stats.n_generated == 32


def test_recurrent_cache_after_generation_matches_fresh_evaluation(mamba_target, mamba_close):
    with Engine(mamba_target, mamba_close, ctx=256, threads=1) as e:
        s = e.session()
        s.generate(e.tokenize(PROMPTS[1]), GenerationSettings(n_predict=30, draft_max=4)).run()
        hist = list(s.history)
        assert s.tgt.tokens == hist[:-1]
        s.tgt.extend([hist[-1]], logits="last")
        after = np.array(s.tgt.ctx.logits(1)[0])
    with Engine(mamba_target, None, ctx=256, threads=1) as fresh:
        fresh.tgt_ctx.decode(hist, 0, logits="last")
        ref = np.array(fresh.tgt_ctx.logits(1)[0])
    np.testing.assert_allclose(after, ref, rtol=1e-3, atol=1e-3)
