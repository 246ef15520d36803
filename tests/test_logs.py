"""Quiet by default on every command: no llama.cpp log line unless -v, exactly one stderr line on failure.

The commands run as subprocesses of the installed `specq`, because llama.cpp could write to the real file
descriptors 1 and 2, which an in-process CliRunner would not see.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from cli_bin import SPECQ
from hfmodels import HFSpec, write_checkpoint

# Prefixes and words of llama.cpp / ggml log lines (and of our logger that carries them under -v).
LLAMA_MARKERS = ("llama_model_loader", "llama_context", "load_tensors", "print_info", "llama_model_quantize",
                 "llama_kv_cache", "llama_graph", "graph_reserve", "sched_reserve", "create_tensor",
                 "init_tokenizer", "ggml_", "gguf_init", "load: ", "specq.llama")


def specq(*args, stdin: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run the installed CLI; bench/chat get --threads 1 (OpenMP threads spin badly on a shared 2-core box)."""
    if args and args[0] in ("bench", "chat", "tune"):
        args = (*args, "--threads", 1)
    env = dict(os.environ, COLUMNS="120", HF_HUB_OFFLINE="1")
    return subprocess.run([SPECQ, *map(str, args)], input=stdin, capture_output=True, text=True, timeout=120,
                          env=env, cwd=cwd)


def leaked(r: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (r.stdout + r.stderr).splitlines() if any(m in line for m in LLAMA_MARKERS)]


def one_error_line(r: subprocess.CompletedProcess) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specq: error: "), r.stderr
    assert "Traceback" not in r.stderr + r.stdout and not leaked(r)
    return lines[0]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("hf")
    spec = HFSpec(arch="Qwen2ForCausalLM", n_layer=1)
    return write_checkpoint(d / "target", spec), write_checkpoint(d / "draft", HFSpec(arch="Qwen2ForCausalLM",
                                                                                        n_layer=1, seed=5))


@pytest.fixture(scope="module")
def truncated(tiny_target, tmp_path_factory) -> Path:
    """A GGUF whose header is fine but whose tensor data is cut: specq names the tensor before llama.cpp loads it."""
    p = tmp_path_factory.mktemp("bad") / "truncated.gguf"
    p.write_bytes(Path(tiny_target).read_bytes()[:300_000])
    return p


@pytest.fixture(scope="module")
def unloadable(tiny_target, tmp_path_factory) -> Path:
    """A well-formed GGUF of an architecture llama.cpp does not know: llama.cpp itself refuses to load it."""
    p = tmp_path_factory.mktemp("bad") / "unknown-arch.gguf"
    p.write_bytes(Path(tiny_target).read_bytes().replace(b"llama", b"llamq"))
    return p


# ---- normal runs print no llama.cpp log line --------------------------------------------------
def test_bench_is_quiet(tiny_target, tiny_close):
    r = specq("bench", "--target", tiny_target, "--draft", tiny_close, "--n-predict", 8)
    assert r.returncode == 0, r.stderr
    assert "speed-up" in r.stdout + r.stderr  # it did run and report
    assert leaked(r) == []


def test_bench_json_quiet_has_only_json(tiny_target, tiny_close):
    r = specq("bench", "--target", tiny_target, "--draft", tiny_close, "--n-predict", 8, "--json", "-", "-q")
    assert r.returncode == 0 and r.stderr == ""
    assert json.loads(r.stdout)["runs"]


def test_piped_chat_is_quiet(tiny_target, tiny_close):
    r = specq("chat", "--target", tiny_target, "--draft", tiny_close, "--n-predict", 8, stdin="hello\nagain\n")
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stderr.strip().splitlines()[-1])  # the one stats line is all that stderr holds
    assert stats["turns"] == 2 and len(r.stderr.strip().splitlines()) == 1
    assert leaked(r) == []


def test_convert_with_quantize_is_quiet(checkpoints, tmp_path):
    target, draft = checkpoints
    r = specq("convert", target, "--draft", draft, "--out", tmp_path / "pair", "--quant", "Q4_K_M")
    assert r.returncode == 0, r.stderr
    assert "pair:" in r.stdout and (tmp_path / "pair" / "specq-pair.toml").is_file()
    assert leaked(r) == []


def test_convert_quiet_prints_only_results(checkpoints, tmp_path):
    r = specq("convert", checkpoints[0], "--out", tmp_path / "pair", "--quant", "Q8_0", "-q")
    assert r.returncode == 0 and r.stderr == ""
    assert [line.split(":")[0] for line in r.stdout.splitlines()] == ["target", "pair"]


def test_tune_is_quiet(tiny_target, tiny_close):
    r = specq("tune", "--target", tiny_target, "--draft", tiny_close, "--n-predict", 8)
    assert r.returncode == 0, r.stderr
    assert "recommended" in r.stdout + r.stderr and leaked(r) == []


@pytest.mark.parametrize("args", [["doctor"], ["doctor", "--json"], ["presets"]])
def test_doctor_and_presets_are_quiet(args):
    r = specq(*args)
    assert r.returncode == 0 and r.stderr == "" and leaked(r) == []


def test_plan_is_quiet(tiny_target, tiny_close):
    r = specq("plan", "--target", tiny_target, "--draft", tiny_close, "--vram", "4GiB", "--json")
    assert r.returncode == 0 and r.stderr == "" and leaked(r) == []
    assert json.loads(r.stdout)["fits"] is True


# ---- failures: exactly one line on stderr -----------------------------------------------------
def test_bench_on_a_truncated_model_fails_in_one_line(truncated):
    r = specq("bench", "--target", truncated, "--n-predict", 4)
    assert r.returncode == 1
    assert "model file is truncated" in one_error_line(r)


def test_bench_on_a_model_llama_cpp_refuses_fails_in_one_line(unloadable):
    r = specq("bench", "--target", unloadable, "--n-predict", 4)
    assert r.returncode == 1
    assert "could not load the model" in one_error_line(r)


def test_chat_on_a_truncated_model_fails_in_one_line(truncated):
    r = specq("chat", "--target", truncated, "--n-predict", 4, stdin="hi\n")
    assert r.returncode == 1
    assert "model file is truncated" in one_error_line(r)


def test_bench_with_a_draft_window_for_another_vocabulary_fails_in_one_line(tiny_target, tiny_incompatible):
    r = specq("bench", "--target", tiny_target, "--draft", tiny_incompatible, "--n-predict", 4, "--ctx", 512,
              "--ctx-draft", 256)
    assert r.returncode == 2  # a usage error
    assert "sees the whole context" in one_error_line(r)


def test_tune_on_a_truncated_model_fails_in_one_line(truncated, tiny_close):
    r = specq("tune", "--target", truncated, "--draft", tiny_close, "--n-predict", 4)
    assert r.returncode == 1 and "model file is truncated" in one_error_line(r)


def test_convert_of_a_missing_folder_fails_in_one_line(tmp_path):
    r = specq("convert", tmp_path / "nope", "--out", tmp_path / "out")
    assert r.returncode == 1 and "model directory not found" in one_error_line(r)


def test_convert_unknown_preset_fails_in_one_line(tmp_path):
    r = specq("convert", "--preset", "no-such-pair", "--out", tmp_path / "out")
    assert r.returncode == 2 and "unknown preset (no-such-pair)" in one_error_line(r)


def test_plan_that_does_not_fit_fails_in_one_line(tiny_target, tiny_close):
    r = specq("plan", "--target", tiny_target, "--draft", tiny_close, "--vram", "1GiB")
    assert r.returncode == 1 and "does not fit" in one_error_line(r)


def test_bad_flag_value_fails_in_one_line(tiny_target):
    r = specq("plan", "--target", tiny_target, "--vram", "12XB")
    assert r.returncode == 2 and "not a memory size" in one_error_line(r)


# ---- -v shows llama.cpp's log ------------------------------------------------------------------
def test_verbose_bench_shows_llama_log(tiny_target, tiny_close):
    r = specq("bench", "--target", tiny_target, "--draft", tiny_close, "--n-predict", 4, "-v")
    assert r.returncode == 0
    assert "llama_model_loader" in r.stderr and "llama_context" in r.stderr
    assert not any(m in r.stdout for m in ("llama_model_loader", "specq.llama"))  # logs stay off stdout


def test_verbose_chat_shows_llama_log(tiny_target):
    r = specq("chat", "--target", tiny_target, "--n-predict", 4, "-v", stdin="hi\n")
    assert r.returncode == 0 and "llama_model_loader" in r.stderr


def test_verbose_convert_shows_the_quantizer_log(checkpoints, tmp_path):
    r = specq("convert", checkpoints[0], "--out", tmp_path / "pair", "--quant", "Q4_K_M", "-v")
    assert r.returncode == 0 and "llama_model_quantize" in r.stderr


def test_verbose_failure_shows_why_llama_failed(unloadable):
    r = specq("bench", "--target", unloadable, "--n-predict", 4, "-v")
    assert r.returncode == 1
    assert "llama_model_load" in r.stderr or "llama_model_loader" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("specq: error: ")


def test_every_command_takes_verbose_and_quiet():
    import typer

    from specq.cli.main import app

    group = typer.main.get_command(app)
    for name, cmd in group.commands.items():
        opts = {o for p in cmd.params for o in p.opts}
        assert {"-v", "--verbose", "-q", "--quiet"} <= opts, name
