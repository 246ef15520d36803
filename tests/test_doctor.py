"""`specq doctor`: the report's shape on this machine (a CPU-only build), and the verdict for every case."""

from __future__ import annotations

import json
import os
import stat

import pytest
from typer.testing import CliRunner

from specq.cli.main import app
from specq.native.commands import doctor as D

GiB = 1 << 30
CPU_INFO = "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 |"
CPU_DEV = {"name": "CPU", "description": "AMD EPYC", "type": "CPU", "memory_total": 64 * GiB, "memory_free": 60 * GiB}
RTX4090 = D.NvidiaGpu(0, "NVIDIA GeForce RTX 4090", "8.9", 24 * GiB, "00000000:01:00.0", "nvidia-smi")
RTX3090 = D.NvidiaGpu(1, "NVIDIA GeForce RTX 3090", "8.6", 24 * GiB, "00000000:02:00.0", "nvidia-smi")


def cuda_dev(i: int, desc: str, bus: str | None = None, total: int = 24 * GiB) -> dict:
    return {"name": f"CUDA{i}", "description": desc, "type": "GPU", "memory_total": total,
            "memory_free": total - GiB, "device_id": bus}


def test_cli_json_on_this_machine():
    r = CliRunner().invoke(app, ["doctor", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert set(doc) >= {"specq_version", "llama_cpp_python_version", "system_info", "gpu_offload", "devices",
                        "verdict"}
    assert doc["gpu_offload"] is False  # this machine's llama-cpp-python is a CPU build
    assert [d["name"] for d in doc["devices"]] == ["CPU"]
    dev = doc["devices"][0]
    assert set(dev) == {"name", "description", "type", "memory_total", "memory_free"}
    assert dev["type"] == "CPU" and dev["memory_total"] > 0 and 0 < dev["memory_free"] <= dev["memory_total"]
    assert doc["system_info"].startswith("CPU :")
    assert doc["verdict"].startswith("CPU-only build — to use your GPU reinstall with CMAKE_ARGS=")
    assert "llama-cpp-python==" + doc["llama_cpp_python_version"] in doc["verdict"]
    # the CPU weight-buffer decision (native/llama/cpu.py) for this machine, consistent with its system info
    cpu = doc["cpu"]
    assert set(cpu) == {"features", "build_has_amx", "extra_buffers", "reason"}
    assert cpu["build_has_amx"] == ("AMX_INT8 = 1" in doc["system_info"])
    assert cpu["extra_buffers"] in ("on", "off", "amx-off") and cpu["reason"]
    if cpu["build_has_amx"] and "amx_int8" in (cpu["features"] or ["amx_int8"]):
        assert cpu["extra_buffers"] != "on"


def test_cli_human_output_ends_with_the_verdict():
    r = CliRunner().invoke(app, ["doctor"])
    assert r.exit_code == 0, r.output
    assert "GPU offload supported: no" in r.stdout
    assert "CPU weight buffers: " in r.stdout
    assert r.stdout.strip().splitlines()[-1].startswith("CPU-only build")


def test_verdict_cpu_only_build():
    v = D.verdict(CPU_INFO, False, [CPU_DEV], [], "0.3.36")
    assert v == ('CPU-only build — to use your GPU reinstall with CMAKE_ARGS="-DGGML_CUDA=on '
                 '-DCMAKE_CUDA_ARCHITECTURES=86;89;90" pip install --no-cache-dir --force-reinstall '
                 "llama-cpp-python==0.3.36")


def test_verdict_cpu_only_build_names_the_card_the_driver_sees():
    v = D.verdict(CPU_INFO, False, [CPU_DEV], [RTX4090], "0.3.36")
    assert v.startswith("CPU-only build, but the driver sees NVIDIA GeForce RTX 4090 (CC 8.9)")
    assert "-DCMAKE_CUDA_ARCHITECTURES=89\"" in v  # the 4090 is 8.9, not 8.6


def test_verdict_cuda_build_without_a_driver():
    # What a CUDA wheel built for 86 prints on a machine with no GPU (NOTES.md).
    info = "CUDA : ARCHS = 860 | NO_VMM = 1 | PEER_MAX_BATCH_SIZE = 128 | " + CPU_INFO
    assert D.verdict(info, False, [CPU_DEV], []) == "CUDA build for CC 8.6, no usable GPU (driver missing)"


def test_verdict_cuda_build_whose_driver_fails():
    info = "CUDA : ARCHS = 860,890 | " + CPU_INFO
    v = D.verdict(info, False, [CPU_DEV], [RTX4090])
    assert v.startswith("CUDA build for CC 8.6, 8.9, no usable GPU (CUDA could not initialise NVIDIA GeForce RTX 4090")


def test_verdict_cuda_build_with_one_device():
    info = "CUDA : ARCHS = 860,890 | USE_GRAPHS = 1 | " + CPU_INFO
    v = D.verdict(info, True, [cuda_dev(0, "NVIDIA GeForce RTX 4090"), CPU_DEV], [RTX4090])
    assert v == "CUDA build, 1 device: NVIDIA GeForce RTX 4090 (CC 8.9, 24 GiB)"


def test_verdict_two_devices_matched_by_pci_bus_id():
    info = "CUDA : ARCHS = 860,890 | " + CPU_INFO
    # ggml lists the 3090 first; nvidia-smi lists the 4090 first: the bus id decides.
    devs = [cuda_dev(0, "NVIDIA GeForce RTX 3090", "0000:02:00.0"), cuda_dev(1, "NVIDIA GeForce RTX 4090", "0000:01:00.0")]
    v = D.verdict(info, True, devs + [CPU_DEV], [RTX4090, RTX3090])
    assert v == ("CUDA build, 2 devices: NVIDIA GeForce RTX 3090 (CC 8.6, 24 GiB), "
                 "NVIDIA GeForce RTX 4090 (CC 8.9, 24 GiB)")


def test_verdict_warns_when_the_build_has_no_code_for_the_card():
    h200 = D.NvidiaGpu(0, "NVIDIA H200", "9.0", 141 * GiB, None, "nvml")
    info = "CUDA : ARCHS = 860 | " + CPU_INFO
    v = D.verdict(info, True, [cuda_dev(0, "NVIDIA H200", total=141 * GiB)], [h200])
    assert "no code for CC 9.0" in v and "-DCMAKE_CUDA_ARCHITECTURES=90\"" in v
    # An 8.6 cubin runs on 8.9 (same major, higher minor): no warning there.
    ok = D.verdict(info, True, [cuda_dev(0, "NVIDIA GeForce RTX 4090")], [RTX4090])
    assert "no code" not in ok


@pytest.mark.parametrize("info,expected", [
    ("CUDA : ARCHS = 860 | NO_VMM = 1 |", ["8.6"]),
    ("CUDA : ARCHS = 860,890,900 | USE_GRAPHS = 1 |", ["8.6", "8.9", "9.0"]),
    ("CUDA : ARCHS = 1200 |", ["12.0"]),
    (CPU_INFO, []),
])
def test_cuda_archs(info, expected):
    assert D.cuda_archs(info) == expected


def _fake_smi(tmp_path, monkeypatch, body: str) -> None:
    exe = tmp_path / "nvidia-smi"
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(D, "_nvml_gpus", lambda: None)


def test_nvidia_smi_is_read_when_present(tmp_path, monkeypatch):
    _fake_smi(tmp_path, monkeypatch, 'echo "0, NVIDIA GeForce RTX 4090, 8.9, 24564, 00000000:01:00.0"\n')
    gpus = D.nvidia_gpus()
    assert gpus == [D.NvidiaGpu(0, "NVIDIA GeForce RTX 4090", "8.9", 24564 << 20, "00000000:01:00.0", "nvidia-smi")]


def test_nvidia_smi_without_a_driver_means_no_gpus(tmp_path, monkeypatch):
    _fake_smi(tmp_path, monkeypatch, "echo \"NVIDIA-SMI has failed because it couldn't communicate with the "
                                     "NVIDIA driver.\"\nexit 9\n")
    assert D.nvidia_gpus() == []
