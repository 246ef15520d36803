"""Atomic output, --force, free disk, quantized output, the pair manifest, and one-line CLI errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from hfmodels import HFSpec, write_checkpoint
from specq.cli.main import app
from specq.convert import pipeline, writer
from specq.manifest import MANIFEST_NAME, load_pair
from specq.errors import ConversionError, ManifestError
from specq.native.llama import ffi as _ffi
from specq.native.runtime.engine import Engine
from specq.native.core.settings import GenerationSettings

SPEC = HFSpec(arch="Qwen2ForCausalLM", n_layer=1)
runner = CliRunner()


@pytest.fixture()
def ckpt(tmp_path):
    return write_checkpoint(tmp_path / "hf", SPEC)


def ggufs(d):
    return sorted(p.name for p in d.iterdir() if p.name.endswith(".gguf")) if d.exists() else []


def test_failure_mid_write_leaves_nothing(tmp_path, ckpt, monkeypatch):
    calls = {"n": 0}
    real = writer.convert_chunk

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt  # as Ctrl-C would, in the middle of the tensor data
        return real(*a, **k)

    monkeypatch.setattr(writer, "convert_chunk", flaky)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        convert_pair_default(ckpt, out, outtype="f32")
    assert calls["n"] == 5
    assert ggufs(out) == [] and list(out.iterdir()) == []  # no .gguf, no temp file, no manifest


def convert_pair_default(src, out, **kw):
    return pipeline.convert_pair(str(src), out, quant=kw.pop("quant", None), **kw)


def test_failure_in_quantize_removes_intermediate(tmp_path, ckpt, monkeypatch):
    def boom(*a, **k):
        raise ConversionError("simulated quantizer failure (test); nothing to do")

    monkeypatch.setattr(pipeline, "quantize_file", boom)
    with pytest.raises(ConversionError):
        pipeline.convert_pair(str(ckpt), tmp_path / "out", quant="Q8_0")
    assert list((tmp_path / "out").iterdir()) == []


def test_existing_output_needs_force(tmp_path, ckpt):
    out = tmp_path / "out"
    first = convert_pair_default(ckpt, out)
    stamp = first.target_path.stat().st_mtime_ns
    with pytest.raises(ConversionError, match="--force"):
        convert_pair_default(ckpt, out)
    assert first.target_path.stat().st_mtime_ns == stamp
    again = convert_pair_default(ckpt, out, force=True)
    assert again.target_path == first.target_path and ggufs(out) == [first.target_path.name]


def test_free_disk_checked_first(tmp_path, ckpt, monkeypatch):
    class Usage:
        free = 1000

    monkeypatch.setattr(pipeline.shutil, "disk_usage", lambda p: Usage)
    with pytest.raises(ConversionError, match=r"need about .* GB, 0\.00 GB free"):
        convert_pair_default(ckpt, tmp_path / "out")
    assert ggufs(tmp_path / "out") == []


@pytest.mark.parametrize("quant,width", [("Q8_0", 64), ("Q4_K_M", 256)])
def test_quantized_output_loads_and_generates(tmp_path, quant, width):
    spec = HFSpec(arch="LlamaForCausalLM", n_layer=1, n_embd=width, n_ff=2 * width, pretok="llama3")
    src = write_checkpoint(tmp_path / "hf", spec)
    seen = []
    res = pipeline.convert_pair(str(src), tmp_path / "out", quant=quant,
                                progress=lambda task, done, total: seen.append((task, done, total)))
    assert res.target_path.name.endswith(f"-{quant}.gguf") and ggufs(tmp_path / "out") == [res.target_path.name]
    assert any(t.startswith("quantize") and d == n for t, d, n in seen)  # progress reached the last tensor
    with _ffi.Model(res.target_path) as m:
        assert m.meta("general.file_type") == str(_ffi.ftype_by_name()[quant])
    with Engine(res.target_path, ctx=128, threads=2) as eng:
        gen = eng.session().generate(eng.tokenize("hello"), GenerationSettings(n_predict=8), speculative=False).run()
    assert len(gen.tokens) >= 1


def test_keep_intermediate(tmp_path, ckpt):
    res = pipeline.convert_pair(str(ckpt), tmp_path / "out", quant="Q8_0", keep_intermediate=True)
    assert [p.name for p in res.intermediates] == ["hf-BF16.gguf"]
    assert ggufs(tmp_path / "out") == ["hf-BF16.gguf", "hf-Q8_0.gguf"]


def test_manifest_round_trip_and_tamper(tmp_path, ckpt):
    dft = write_checkpoint(tmp_path / "dft", HFSpec(arch="Qwen2ForCausalLM", n_layer=1, tied=True, seed=3))
    res = pipeline.convert_pair(str(ckpt), tmp_path / "out", draft=str(dft), quant="Q8_0", draft_quant=None)
    pair = load_pair(tmp_path / "out")
    assert pair.target_path == res.target_path and pair.draft_path == res.draft_path
    assert pair.settings["draft_max"] == "auto" and pair.settings["p_min"] == 0.0
    doc = pair.manifest
    assert doc["format_version"] == 1
    assert doc["target"]["source"] == str(ckpt.resolve()) and doc["target"]["quant"] == "Q8_0"
    assert doc["draft"]["quant"] == "BF16" and doc["draft"]["n_vocab"] == doc["target"]["n_vocab"]
    assert doc["target"]["architecture"] == "qwen2"
    with open(res.draft_path, "r+b") as f:  # flip one byte near the end of the tensor data
        f.seek(-10, os.SEEK_END)
        b = f.read(1)
        f.seek(-10, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(ManifestError, match="does not match its checksum"):
        load_pair(tmp_path / "out")
    res.target_path.unlink()
    with pytest.raises(ManifestError, match="missing"):
        load_pair(tmp_path / "out")


def test_manifest_single_model(tmp_path, ckpt):
    pipeline.convert_pair(str(ckpt), tmp_path / "out", quant=None)
    pair = load_pair(tmp_path / "out")
    assert pair.draft_path is None and "draft" not in pair.manifest
    assert (tmp_path / "out" / MANIFEST_NAME).read_text().startswith("format_version = 1\n")


# ---- CLI: one line on stderr, right exit code ---------------------------------------------------
def cli(*args):
    r = runner.invoke(app, ["convert", *map(str, args)])
    return r.exit_code, r.stderr.strip().splitlines(), r.stdout


def test_cli_converts(tmp_path, ckpt):
    code, err, out = cli(ckpt, "--out", tmp_path / "out", "--quant", "none", "-q")
    assert code == 0 and err == []
    assert "pair:" in out and (tmp_path / "out" / MANIFEST_NAME).is_file()


def test_cli_missing_dir(tmp_path):
    code, err, _ = cli(tmp_path / "nope", "--out", tmp_path / "out")
    assert code == 1 and len(err) == 1 and err[0].startswith("specq: error: model directory not found")


def test_cli_unsupported_architecture(tmp_path, ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    code, err, _ = cli(ckpt, "--out", tmp_path / "out")
    assert code == 1 and len(err) == 1
    assert "unsupported architecture GPTNeoXForCausalLM" in err[0] and "Qwen3ForCausalLM" in err[0]


def test_cli_pickle_only(tmp_path, ckpt):
    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    code, err, _ = cli(ckpt, "--out", tmp_path / "out")
    assert code == 1 and len(err) == 1
    assert "pytorch_model.bin" in err[0] and "arbitrary code" in err[0]


def test_cli_bad_quant_is_usage_error(tmp_path, ckpt):
    code, err, _ = cli(ckpt, "--out", tmp_path / "out", "--quant", "Q9_X")
    assert code == 2 and len(err) == 1 and "unknown --quant type (Q9_X)" in err[0]


def test_cli_offline_uncached_repo(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf-home"))
    env.pop("HF_TOKEN", None)
    r = subprocess.run([sys.executable, "-m", "specq.cli.main", "convert", "someone/not-cached-model",
                        "--out", str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert "HF_HUB_OFFLINE" in lines[0] and "someone/not-cached-model" in lines[0]


def test_full_disk_mid_write_is_one_line_and_leaves_nothing(tmp_path, ckpt, monkeypatch):
    import errno

    calls = {"n": 0}
    real = writer.convert_chunk

    def disk_full(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out"))
        return real(*a, **k)

    monkeypatch.setattr(writer, "convert_chunk", disk_full)
    code, err, _ = cli(ckpt, "--out", tmp_path / "out", "--quant", "none", "--outtype", "f32")
    assert calls["n"] == 3
    assert code == 1 and len(err) == 1 and err[0].startswith("specq: error: no space left on the device")
    assert ggufs(tmp_path / "out") == [] and not any((tmp_path / "out").glob("*.tmp*"))
