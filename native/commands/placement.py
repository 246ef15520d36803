"""Where each model runs: GPU layers for target and draft, devices, splits, and the VRAM budget planner."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ...errors import UsageError
from ..runtime.config import choose_flash_attn
from ..llama import ffi as _ffi

log = logging.getLogger("specq.placement")

ALL_LAYERS = 999  # llama.cpp clamps n_gpu_layers to the model's layer count (+ output)


@dataclass(frozen=True)
class Placement:
    ngl: int
    ngl_draft: int
    main_gpu: int = 0
    tensor_split: tuple[float, ...] | None = None
    draft_tensor_split: tuple[float, ...] | None = None
    devices: tuple[str, ...] | None = None
    draft_devices: tuple[str, ...] | None = None
    cpu_amx: bool = False  # let llama.cpp use its AMX weight buffer (native/llama/cpu.py: off by default)
    flash_attn: str = "auto"  # the target's attention path: on, off or auto (llama.cpp's choice, or Engine's)
    draft_flash_attn: str = "auto"
    rpc: tuple[str, ...] = ()  # RPC servers whose devices were added (--rpc)



def default_ngl() -> int:
    """All layers when llama.cpp can offload to a GPU, else 0."""
    return ALL_LAYERS if _ffi.supports_gpu_offload() else 0


def parse_split(text: str | None) -> tuple[float, ...] | None:
    """--tensor-split "3,1": the share of layers per device."""
    if not text:
        return None
    try:
        parts = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise UsageError(f"--tensor-split takes numbers separated by commas ({text}); e.g. 3,1")
    if any(p < 0 for p in parts) or not any(parts):
        raise UsageError(f"--tensor-split needs non-negative shares, not all zero ({text})")
    return parts


def parse_devices(text: str | None) -> tuple[str, ...] | None:
    """--device "CUDA0,CUDA1": ggml device names as `specq doctor` lists them."""
    if not text:
        return None
    return tuple(x.strip() for x in text.split(",") if x.strip())


def resolve_placement(target: str, draft: str | None, *, ctx: int, ngl: int | None = None,
                      ngl_draft: int | None = None, vram_budget: str | None = None, main_gpu: int = 0,
                      tensor_split: str | None = None, device: str | None = None,
                      draft_device: str | None = None, cpu_amx: bool = False,
                      flash_attn: str = "auto", rpc: str | None = None, parallel: int = 1) -> Placement:
    """Turn the placement flags into a Placement; an explicit --ngl/--ngl-draft wins over the planner.

    --rpc adds the servers' devices (RPC0, RPC1, ...) to llama.cpp's list first: the target then spreads over
    them and the local GPUs (llama.cpp's default order, remote first) or over --device; the draft stays on
    the local GPUs, or the CPU, unless --draft-device says otherwise."""
    if ngl is not None and ngl < 0:
        raise UsageError(f"--ngl must be >= 0 ({ngl})")
    if ngl_draft is not None and ngl_draft < 0:
        raise UsageError(f"--ngl-draft must be >= 0 ({ngl_draft})")
    if main_gpu < 0:
        raise UsageError(f"--main-gpu must be >= 0 ({main_gpu})")
    split = parse_split(tensor_split)
    draft_split = None
    endpoints: tuple[str, ...] = ()
    local_gpus = None
    if rpc:
        from . import rpc as rpc_backend

        endpoints = tuple(str(e) for e in rpc_backend.parse_endpoints(rpc))
        rpc_backend.connect(rpc)  # probed first: an unreachable server is one line, before any model loads
        local_gpus = tuple(rpc_backend.local_gpu_names())
    n_tgt, n_dft = ngl, ngl_draft
    if vram_budget is not None:
        from .plan import choose_layers

        plan_tgt, plan_dft, plan = choose_layers(target, draft, vram_budget, ctx)
        if n_tgt is not None and n_tgt > plan_tgt:
            log.warning("--ngl %d exceeds the VRAM budget (the plan fits %d target layers); "
                        "loading may run out of memory", n_tgt, plan_tgt)
        if n_dft is not None and draft is not None and n_dft > plan_dft:
            log.warning("--ngl-draft %d exceeds the VRAM budget (the plan fits %d draft layers)", n_dft, plan_dft)
        n_tgt = plan_tgt if n_tgt is None else n_tgt
        n_dft = plan_dft if n_dft is None else n_dft
        if split is None and len(plan.devices) > 1:
            split = tuple(float(x) for x in plan.tensor_split("target"))
            local = [i for i, d in enumerate(plan.devices) if not d.endpoint]  # the draft never goes remote
            shares = plan.tensor_split("draft")
            draft_split = tuple(float(shares[i]) for i in local) if shares and len(local) > 1 else None
    gpu = default_ngl()
    n_tgt = gpu if n_tgt is None else n_tgt
    n_dft = gpu if n_dft is None else n_dft
    if draft is not None and n_tgt > 0 and n_dft == 0 and _ffi.supports_gpu_offload() and local_gpus != ():
        log.warning("the target is on the GPU but the draft is on the CPU: drafting will be slow and "
                    "speculation may not pay; use --ngl-draft (or --vram-budget)")
    devices, draft_devices = parse_devices(device), parse_devices(draft_device)
    if rpc and draft_devices is None:
        draft_devices = local_gpus  # () → the CPU: never a remote device by default
    return Placement(ngl=n_tgt, ngl_draft=n_dft, main_gpu=main_gpu, tensor_split=split,
                     draft_tensor_split=draft_split or (None if rpc else split), devices=devices,
                     draft_devices=draft_devices, cpu_amx=cpu_amx,
                     flash_attn=_target_flash_attn(flash_attn, n_tgt, devices, parallel),
                     draft_flash_attn=choose_flash_attn(flash_attn, n_dft,
                                                        draft_devices if draft_devices is not None else devices,
                                                        parallel),
                     rpc=endpoints)


def _target_flash_attn(flag: str, ngl: int, devices: tuple[str, ...] | None, parallel: int) -> str:
    """The target's attention path, except where auto would turn it on for sequences sharing one cache: Engine
    decides there, knowing whether the target keeps a stream per sequence (config.choose_flash_attn)."""
    chosen = choose_flash_attn(flag, ngl, devices, parallel)
    return flag if flag == "auto" and chosen == "on" else chosen
