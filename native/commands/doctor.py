"""`specq doctor` as a library: what this llama.cpp build can run on, as data, and a one-line verdict.

The verdict is a pure function of what was inspected (system info, offload support, ggml devices, NVIDIA
GPUs seen by NVML or nvidia-smi), so every case is testable on a machine without a GPU.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass
from typing import Sequence

from ...version import __version__
from ...errors import SpecqError

log = logging.getLogger("specq.doctor")

GiB = 1 << 30
DEFAULT_ARCHS = "86;89;90"  # RTX 30xx, RTX 40xx, H100/H200: what to build when the card is unknown
REQUIRED_DEVICE_KEYS = ("name", "description", "type", "memory_total", "memory_free")


@dataclass(frozen=True)
class NvidiaGpu:
    index: int
    name: str
    compute_capability: str | None  # "8.9"
    memory_total: int | None  # bytes
    pci_bus_id: str | None  # as NVML/nvidia-smi print it ("00000000:01:00.0")
    source: str  # "nvml" | "nvidia-smi"


# ---- inspecting ------------------------------------------------------------------------------
def _nvml_gpus() -> list[NvidiaGpu] | None:
    try:
        import pynvml  # nvidia-ml-py; optional, never a dependency
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        log.debug("NVML unavailable: %s", e)
        return None
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
            bus = pynvml.nvmlDeviceGetPciInfo(h).busId
            out.append(NvidiaGpu(i, name.decode() if isinstance(name, bytes) else str(name), f"{major}.{minor}",
                                 int(pynvml.nvmlDeviceGetMemoryInfo(h).total),
                                 bus.decode() if isinstance(bus, bytes) else str(bus), "nvml"))
        return out
    except Exception as e:
        log.debug("NVML query failed: %s", e)
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def parse_nvidia_smi(text: str) -> list[NvidiaGpu]:
    """Rows of `--query-gpu=index,name,compute_cap,memory.total,pci.bus_id --format=csv,noheader,nounits`."""
    gpus = []
    for line in text.splitlines():
        cols = [c.strip() for c in line.split(",")]
        if len(cols) < 5 or not cols[0].isdigit():
            continue
        cc = cols[2] if re.fullmatch(r"\d+\.\d+", cols[2]) else None
        mem = int(float(cols[3]) * (1 << 20)) if re.fullmatch(r"[\d.]+", cols[3]) else None
        gpus.append(NvidiaGpu(int(cols[0]), cols[1], cc, mem, cols[4] or None, "nvidia-smi"))
    return gpus


def _smi_gpus(timeout: float = 10.0) -> list[NvidiaGpu]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    try:
        r = subprocess.run([exe, "--query-gpu=index,name,compute_cap,memory.total,pci.bus_id",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as e:
        log.debug("nvidia-smi failed: %s", e)
        return []
    if r.returncode != 0:
        log.debug("nvidia-smi exit %d: %s", r.returncode, r.stderr.strip() or r.stdout.strip())
        return []
    return parse_nvidia_smi(r.stdout)


def nvidia_gpus() -> list[NvidiaGpu]:
    """NVIDIA GPUs as the driver sees them (NVML if importable, else nvidia-smi); [] when neither answers."""
    gpus = _nvml_gpus()
    return gpus if gpus else _smi_gpus()


# ---- reading the build -------------------------------------------------------------------------
def cuda_archs(system_info: str) -> list[str]:
    """Compute capabilities a CUDA build carries code for, from 'CUDA : ARCHS = 860,890 | ...' → ['8.6', '8.9']."""
    m = re.search(r"CUDA\s*:\s*ARCHS\s*=\s*([0-9,\s]+)", system_info)
    if not m:
        return []
    out = []
    for a in m.group(1).replace(" ", "").split(","):
        if a.isdigit() and len(a) >= 2:
            v = int(a) // 10  # __CUDA_ARCH_LIST__ entries are 10 × (10·major + minor)
            out.append(f"{v // 10}.{v % 10}")
    return out


def gpu_backend(system_info: str) -> str | None:
    """The GPU backend compiled in, as ggml names it in llama_print_system_info (None: CPU only)."""
    for name in ("CUDA", "ROCm", "HIP", "Vulkan", "Metal", "SYCL", "MUSA", "CANN", "OpenCL"):
        if re.search(rf"(^|\|)\s*{name}\s*:", system_info, re.IGNORECASE):
            return name
    return None


def _cc_runs(device_cc: str, built: Sequence[str]) -> bool:
    """A cubin for X.y runs on X.z with z ≥ y (same major)."""
    dmaj, dmin = (int(x) for x in device_cc.split("."))
    return any(int(b.split(".")[0]) == dmaj and int(b.split(".")[1]) <= dmin for b in built)


def _match_cc(devices: Sequence[dict], gpus: Sequence[NvidiaGpu]) -> list[str | None]:
    """Compute capability per ggml GPU device: by PCI bus id where ggml knows it, else by order."""
    by_bus = {_norm_bus(g.pci_bus_id): g for g in gpus if g.pci_bus_id}
    out = []
    for i, d in enumerate(devices):
        g = by_bus.get(_norm_bus(d.get("device_id") or "")) if d.get("device_id") else None
        if g is None and i < len(gpus):
            g = gpus[i]
        out.append(g.compute_capability if g else None)
    return out


def _norm_bus(bus: str) -> str:
    # NVML prints "00000000:01:00.0", ggml "0000:01:00.0": compare without the domain's leading zeros.
    dom, _, rest = bus.lower().partition(":")
    return f"{dom.lstrip('0') or '0'}:{rest}"


def reinstall_hint(ccs: Sequence[str], llama_cpp_version: str) -> str:
    archs = ";".join(sorted({c.replace(".", "") for c in ccs})) if ccs else DEFAULT_ARCHS
    return (f'CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES={archs}" pip install --no-cache-dir '
            f"--force-reinstall llama-cpp-python=={llama_cpp_version}")


def verdict(system_info: str, gpu_offload: bool, devices: Sequence[dict], gpus: Sequence[NvidiaGpu],
            llama_cpp_version: str = "0.3.36") -> str:
    """One line: what this install will run on, and what to do if that is not the GPU."""
    backend = gpu_backend(system_info)
    built = cuda_archs(system_info)
    gpu_devs = [d for d in devices if d.get("type") in ("GPU", "IGPU")]
    seen_ccs = [g.compute_capability for g in gpus if g.compute_capability]
    if backend is None and not gpu_devs:
        msg = "CPU-only build"
        if gpus:
            msg += ", but the driver sees " + ", ".join(
                f"{g.name}" + (f" (CC {g.compute_capability})" if g.compute_capability else "") for g in gpus)
        return f"{msg} — to use your GPU reinstall with {reinstall_hint(seen_ccs, llama_cpp_version)}"
    label = f"{backend} build" if backend else "GPU build"
    if backend == "CUDA" and built:
        label += " for CC " + ", ".join(built)
    if not gpu_offload or not gpu_devs:
        if gpus:
            names = ", ".join(g.name for g in gpus)
            return (f"{label}, no usable GPU ({backend or 'the backend'} could not initialise {names}; "
                    "the driver may be older than the CUDA toolkit the wheel was built with: run with -v)")
        return f"{label}, no usable GPU (driver missing)"
    ccs = _match_cc(gpu_devs, gpus)
    descs = []
    warnings = []
    for d, cc in zip(gpu_devs, ccs):
        info = ([f"CC {cc}"] if cc else []) + [f"{d.get('memory_total', 0) / GiB:.0f} GiB"]
        descs.append(f"{d.get('description') or d.get('name')} ({', '.join(info)})")
        if backend == "CUDA" and cc and built and not _cc_runs(cc, built):
            warnings.append(f"no code for CC {cc} in this build: reinstall with "
                            f"{reinstall_hint([cc], llama_cpp_version)}")
    n = len(gpu_devs)
    line = f"{backend or 'GPU'} build, {n} device{'s' if n != 1 else ''}: " + ", ".join(descs)
    return line + (" — " + "; ".join(warnings) if warnings else "")


# ---- the report --------------------------------------------------------------------------------
def doctor_report(rpc_servers: str | None = None) -> dict:
    """The doctor report as data (the keys of `specq doctor --json`); with `rpc_servers` ("HOST:PORT,...")
    their devices are added first and listed with the local ones."""
    try:
        from ..llama import ffi as _ffi
    except (OSError, RuntimeError, ImportError) as e:
        raise SpecqError(f"llama.cpp's library could not be loaded ({e}); reinstall llama-cpp-python "
                         "(docs/gpu.md has the CUDA recipe)") from e
    from . import rpc

    if rpc_servers:
        rpc.connect(rpc_servers)
    info = _ffi.system_info()
    offload = _ffi.supports_gpu_offload()
    devs = _ffi.devices()
    dev_dicts = [{k: asdict(d)[k] for k in REQUIRED_DEVICE_KEYS} for d in devs]
    with_ids = [dict(dd, device_id=d.device_id) for dd, d in zip(dev_dicts, devs)]
    gpus = nvidia_gpus()
    version = _ffi.llama_cpp_python_version()
    return {
        "specq_version": __version__,
        "llama_cpp_python_version": version,
        "system_info": info,
        "gpu_offload": offload,
        "devices": dev_dicts,
        "cuda_archs": cuda_archs(info),
        "nvidia_gpus": [asdict(g) for g in gpus],
        "verdict": verdict(info, offload, with_ids, gpus, version),
        "cpu": _ffi.cpu_policy().as_dict(),
        "rpc": {**rpc.status(), "servers": rpc.servers(), "remote_devices": rpc.remote_devices()},
    }
