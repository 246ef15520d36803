"""llama.cpp's own vocabulary files (`models/ggml-vocab-*.gguf` with their `.inp`/`.out` tokenizer tests) from the
llama-cpp-python sdist of the installed version, kept in specq's cache. `.ci/run` fetches them before the tests:

    python tests/llama_vocabs.py            # pip download the sdist (pip's cache serves it again), extract them

A test that needs them skips where they are missing, which CI counts as a failure."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

NAMES = ("llama-spm", "gemma-4", "qwen2", "qwen35", "gpt-2")


def vocab_dir() -> Path:
    from specq.machine import cache_dir
    from specq.native.llama import ffi

    return cache_dir() / "vocab" / ffi.llama_cpp_python_version()


def vocab_path(name: str) -> Path | None:
    p = vocab_dir() / f"ggml-vocab-{name}.gguf"
    return p if p.is_file() else None


def inp_texts(name: str) -> list[str]:
    """The texts of the vocabulary's tokenizer test (`.inp`: texts separated by a marker line)."""
    p = vocab_dir() / f"ggml-vocab-{name}.gguf.inp"
    return p.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")[:-1] if p.is_file() else []


def fetch(sdist: Path | None = None) -> Path:
    """Extract models/ggml-vocab-* from the sdist (pip downloads it unless given) into vocab_dir()."""
    from specq.native.llama import ffi

    out = vocab_dir()
    if all(vocab_path(n) for n in NAMES):
        return out
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        if sdist is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
                            "llama-cpp-python", f"llama-cpp-python=={ffi.llama_cpp_python_version()}", "-d", tmp],
                           check=True)
            sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            for m in tar.getmembers():
                name = m.name.rsplit("/", 1)[-1]
                if m.isfile() and "/vendor/llama.cpp/models/" in m.name and name.startswith("ggml-vocab-"):
                    f = tar.extractfile(m)
                    (out / name).write_bytes(f.read())
    return out


if __name__ == "__main__":
    print(fetch(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
