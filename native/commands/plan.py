"""The VRAM planner: how many layers of the draft and the target fit on the GPU(s), from GGUF metadata only.

Nothing is loaded. Sizes come from the tensor infos (bytes per `blk.N.` layer by tensor type), the KV cache
from the attention shape and the cache type, and the compute buffer from a documented estimate:

    compute = 4 B · n_ubatch · (2·n_ff + 4·n_embd)     on every device holding part of a model
            + 4 B · n_ubatch · n_vocab                   on the device holding its output layer (the logits)
            + 4 B · n_ubatch · n_head · n_ctx            only with flash attention off (the KQ scores)

This is above what llama.cpp reports for Qwen2.5 0.5B-32B at n_ubatch 512 with flash attention (~300 MiB).
Sliding-window layers (Gemma 3's local layers) hold pad256(min(n_ctx, window + n_ubatch)) positions, not n_ctx:
specq creates its contexts with llama.cpp's small SWA cache (swa_full off; native/llama/ffi.py Context).
Hybrid (qwen35) layers with linear attention hold a fixed F32 recurrent state instead of a KV cache; a target
whose architecture allows it keeps 1 + ROLLBACK_SNAPSHOTS copies of it (llama.cpp's n_rs_seq, native/runtime/engine.py).
Placement follows llama.cpp: `n_gpu_layers = k` puts the output layer and the last k-1 blocks on the GPU
(k = n_layer + 1 is everything); the token embeddings always stay on the CPU; each block's KV cache lives
with the block. The draft is placed fully first, then as many target layers as fit; several devices are
filled greedily in order (contiguous runs of layers, as llama.cpp's tensor_split assigns them).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Sequence

from ...errors import ModelFileError, PlanError, UsageError
from ..llama.gguf_check import check_model_file
from ..llama.gguf_header import GGUFHeader

log = logging.getLogger("specq.plan")

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
DEFAULT_CTX = 4096  # specq's --ctx default; the floor of the automatic context search
CTX_PAD = 256  # llama.cpp rounds n_ctx up to a multiple of 256
N_UBATCH = 512  # specq's contexts use n_batch = n_ubatch = 512
# llama.cpp's sliding-window layer pattern where the file gives none (llama_model_*::load_arch_hparams):
# every n-th layer is global, the others local
SWA_PATTERN_DEFAULT = {"gemma3": 6}
# Linear-attention hybrids read here: architecture → whether llama.cpp can roll their state back (n_rs_seq)
RECURRENT_HYBRIDS = {"qwen35": True, "qwen35moe": True, "qwen3next": False}
ROLLBACK_SNAPSHOTS = 16  # the engine's n_rs_seq on a target (rollback_tokens = AUTO_DRAFT_CAP)
# Per device, for an absolute budget (a card's size): CUDA context, cuBLAS workspace, allocator slack.
# The same margin llama.cpp's own `--fit` keeps by default. A fraction of *free* memory is its own margin.
RESERVE_BYTES = 1 * GiB
CACHE_TYPES = {"f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18)}

MAX_DEVICE_BYTES = 64 << 40  # far beyond any accelerator; larger is a typo, not a plan
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": KiB, "mib": MiB, "gib": GiB, "tib": 1 << 40}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


# ---- sizes -----------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    """'24GiB', '24GB', '22.5GiB', '24000MiB' → bytes. Raises UsageError on anything else."""
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise UsageError(f"not a memory size ({text!r}); write it like 24GiB, 24GB, 22.5GiB or 24000MiB")
    value = float(m.group(1)) * _UNITS[unit]
    if value < 1:
        raise UsageError(f"memory size must be positive ({text!r}); write it like 24GiB")
    if value > MAX_DEVICE_BYTES:
        raise UsageError(f"memory size is implausibly large ({text!r}, over {MAX_DEVICE_BYTES >> 40} TiB for one "
                         "device); write the size of one GPU like 24GiB or 80GiB")
    return int(value)


def parse_budget(text: str) -> float | list[int]:
    """A VRAM budget: a fraction of free memory ('0.9') or sizes, one per device ('24GiB' or '24GiB,24GiB')."""
    s = str(text).strip()
    try:
        frac = float(s)
    except ValueError:
        frac = None
    if frac is not None:
        if not 0.0 < frac <= 1.0:
            raise UsageError(f"a VRAM fraction must be in (0, 1] ({text!r}); use e.g. 0.9, or a size like 22GiB")
        return frac
    parts = [p for p in s.split(",")]
    if not s or any(not p.strip() for p in parts):
        raise UsageError(f"empty VRAM size in ({text!r}); write one size per GPU like 24GiB,24GiB")
    return [parse_size(p) for p in parts]


def fmt_bytes(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.0f} MiB"


# ---- model shapes from GGUF metadata ---------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    path: str
    arch: str
    n_layer: int
    n_ctx_train: int
    n_embd: int
    n_head: int
    n_ff: int
    n_vocab: int
    kv_elems: tuple[tuple[int, int], ...]  # per block: (K elements, V elements) per token
    layer_bytes: tuple[int, ...]  # weights per block
    output_bytes: int  # the output layer: output.weight (or the tied token_embd copy), output_norm, others
    input_bytes: int  # token_embd: always on the CPU
    tied_embeddings: bool = False  # no output.weight: output_bytes includes a second copy of token_embd
    swa_window: int = 0  # sliding window of the local layers (0: none)
    swa_layers: tuple[bool, ...] = ()  # per block: a local (sliding-window) layer
    state_bytes: tuple[int, ...] = ()  # per block: one copy of its recurrent state (linear-attention layers)
    rs_rollback: bool = False  # llama.cpp keeps n_rs_seq snapshots of that state for this architecture

    def state_copies(self, which: str) -> int:
        """Copies of the recurrent state a context holds: the target's keeps the rollback snapshots."""
        return 1 + (ROLLBACK_SNAPSHOTS if which == "target" and self.rs_rollback else 0)

    def layer_memory(self, layer: int, ctx_pad: int, cache_type: str, which: str, n_seq: int = 1) -> int:
        """The layer's KV cache and recurrent state, in bytes, for n_seq sequences (ctx_pad: all of theirs)."""
        state = self.state_bytes[layer] * self.state_copies(which) * n_seq if self.state_bytes else 0
        return self.kv_per_token(layer, cache_type) * self.kv_cells(layer, ctx_pad, n_seq=n_seq) + state

    def kv_cells(self, layer: int, ctx_pad: int, n_ubatch: int = N_UBATCH, n_seq: int = 1) -> int:
        """Positions the layer's KV cache holds: n_ctx, or about window + n_ubatch for a local layer (a window
        per sequence in llama.cpp's unified cache)."""
        if self.swa_window and self.swa_layers[layer]:
            return min(ctx_pad, -(-(self.swa_window * n_seq + n_ubatch) // CTX_PAD) * CTX_PAD)
        return ctx_pad

    @property
    def weights_bytes(self) -> int:
        """Weights once loaded (CPU + GPU), the tied copy included."""
        return sum(self.layer_bytes) + self.output_bytes + self.input_bytes

    @property
    def file_bytes(self) -> int:
        """Tensor data in the file."""
        return self.weights_bytes - (self.input_bytes if self.tied_embeddings else 0)

    def kv_per_token(self, layer: int, cache_type: str) -> int:
        k, v = self.kv_elems[layer]
        block, size = CACHE_TYPES[cache_type]
        return (k // block) * size + (v // block) * size

    def compute_bytes(self, ctx: int, with_logits: bool, flash_attn: bool, n_ubatch: int = N_UBATCH) -> int:
        b = 4 * n_ubatch * (2 * self.n_ff + 4 * self.n_embd)
        if with_logits:
            b += 4 * n_ubatch * self.n_vocab
        if not flash_attn:
            b += 4 * n_ubatch * self.n_head * ctx
        return b


def _per_layer(value, n_layer: int, what: str, path: str) -> list[int]:
    if isinstance(value, list):
        if len(value) != n_layer:
            raise ModelFileError(f"{what} has {len(value)} entries for {n_layer} layers ({path}); the file is corrupt")
        return [int(v) for v in value]
    return [int(value)] * n_layer


def model_shape(path: str, header: GGUFHeader | None = None) -> ModelShape:
    h = header or check_model_file(path)  # a truncated or inconsistent file is refused, not planned

    def need(key: str):
        v = h.arch_key(key)
        if v is None:
            raise ModelFileError(f"GGUF metadata lacks {h.arch}.{key} ({path}); the file is incomplete or "
                                 "not a language model")
        return v

    n_layer = int(need("block_count"))
    n_embd = int(need("embedding_length"))
    n_head_l = _per_layer(need("attention.head_count"), n_layer, "head_count", path)
    n_head = max(n_head_l) if n_head_l else 1
    kv_l = _per_layer(h.arch_key("attention.head_count_kv", n_head), n_layer, "head_count_kv", path)
    k_len = int(h.arch_key("attention.key_length", n_embd // max(n_head, 1)))
    v_len = int(h.arch_key("attention.value_length", n_embd // max(n_head, 1)))
    ff = h.arch_key("feed_forward_length", 4 * n_embd)
    n_ff = max(ff) if isinstance(ff, list) else int(ff)

    layer_bytes = [0] * n_layer
    output = inp = 0
    n_vocab = None
    has_output = False
    for t in h.tensors:
        m = re.match(r"blk\.(\d+)\.", t.name)
        if m and int(m.group(1)) < n_layer:
            layer_bytes[int(m.group(1))] += t.nbytes
        elif t.name.startswith("token_embd."):
            inp += t.nbytes
            if t.name == "token_embd.weight" and len(t.shape) >= 2:
                n_vocab = int(t.shape[1])
        else:  # output.weight, output_norm.*, rope factors, anything else outside the blocks
            output += t.nbytes
            has_output = has_output or t.name == "output.weight"
    if not has_output:
        output += inp  # tied embeddings: llama.cpp loads token_embd a second time on the output device
    if n_vocab is None:
        tokens = h.metadata.get("tokenizer.ggml.tokens")
        n_vocab = getattr(tokens, "length", None) or (len(tokens) if isinstance(tokens, list) else 0)
    n_swa, swa = _swa_layers(h, n_layer, path)
    state = _recurrent_state(h, n_layer)
    if state:  # linear-attention layers keep no KV cache
        kv_l = [0 if b else kv for kv, b in zip(kv_l, state)]
    return ModelShape(
        path=str(path), arch=h.arch, n_layer=n_layer, n_ctx_train=int(h.arch_key("context_length", DEFAULT_CTX)),
        n_embd=n_embd, n_head=n_head, n_ff=n_ff, n_vocab=int(n_vocab),
        kv_elems=tuple((kv * k_len, kv * v_len) for kv in kv_l),
        layer_bytes=tuple(layer_bytes), output_bytes=output, input_bytes=inp, tied_embeddings=not has_output,
        swa_window=n_swa, swa_layers=swa, state_bytes=state, rs_rollback=RECURRENT_HYBRIDS.get(h.arch, False))


def _recurrent_state(h: GGUFHeader, n_layer: int) -> tuple[int, ...]:
    """Bytes of one copy of each block's recurrent state (0 for attention blocks), as llama.cpp sizes it:
    F32, conv window (d_conv − 1)·(d_inner + 2·n_group·d_state) plus the state d_state·d_inner; () where the
    architecture is not a linear-attention hybrid read here."""
    if h.arch not in RECURRENT_HYBRIDS:
        return ()
    conv, inner, d_state, groups = (int(h.arch_key(f"ssm.{k}", 0) or 0)
                                    for k in ("conv_kernel", "inner_size", "state_size", "group_count"))
    per_layer = 4 * (max(conv - 1, 0) * (inner + 2 * groups * d_state) + d_state * inner)
    interval = int(h.arch_key("full_attention_interval", 4) or 4)
    n_trunk = n_layer - int(h.arch_key("nextn_predict_layers", 0) or 0)  # MTP blocks are attention blocks
    return tuple(per_layer if il < n_trunk and (il + 1) % interval else 0 for il in range(n_layer))


def _swa_layers(h: GGUFHeader, n_layer: int, path: str) -> tuple[int, tuple[bool, ...]]:
    """(window, which blocks are local) as llama.cpp reads them; (0, ()) where the model has no sliding window
    or its pattern is unknown here (every layer is then counted at full size)."""
    n_swa = int(h.arch_key("attention.sliding_window", 0) or 0)
    pattern = h.arch_key("attention.sliding_window_pattern", SWA_PATTERN_DEFAULT.get(h.arch))
    if n_swa <= 0 or pattern is None:
        return 0, ()
    if isinstance(pattern, list):
        if len(pattern) < n_layer:
            raise ModelFileError(f"sliding_window_pattern has {len(pattern)} entries for {n_layer} layers ({path}); "
                                 "the file is corrupt")
        return n_swa, tuple(bool(x) for x in pattern[:n_layer])
    p = int(pattern)
    return n_swa, tuple(p == 0 or il % p < p - 1 for il in range(n_layer))


# ---- placement -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Device:
    name: str
    budget_bytes: int
    reserve_bytes: int = 0  # counted as used before anything is placed
    endpoint: str | None = None  # an RPC server's device (--rpc): the target may go there, the draft never


@dataclass
class _Fill:
    """Greedy contiguous fill state: bytes used per device, layers per model per device."""

    used: list[int]
    layers: dict[str, list[int]] = field(default_factory=dict)
    parts: dict[str, dict[str, int]] = field(default_factory=dict)  # model → weights/kv/compute on GPU

    def copy(self) -> "_Fill":
        return _Fill(list(self.used), {k: list(v) for k, v in self.layers.items()},
                     {k: dict(v) for k, v in self.parts.items()})


def _items(shape: ModelShape, ngl: int, ctx_pad: int, cache_type: str,
           which: str, n_seq: int = 1) -> list[tuple[int, int, bool]]:
    """(weights, kv) of each offloaded layer in llama.cpp's device order; the bool marks the output layer."""
    ngl = max(0, min(ngl, shape.n_layer + 1))
    start = shape.n_layer + 1 - ngl
    items = [(shape.layer_bytes[il], shape.layer_memory(il, ctx_pad, cache_type, which, n_seq), False)
             for il in range(start, shape.n_layer)]
    if ngl >= 1:
        items.append((shape.output_bytes, 0, True))
    return items


def _place(fill: _Fill, devices: Sequence[Device], which: str, shape: ModelShape, ngl: int, ctx: int,
           cache_type: str, flash_attn: bool, n_seq: int = 1) -> _Fill | None:
    """Place `ngl` layers of a model after what `fill` holds; None when they do not fit. `ctx` is one sequence's
    context; n_seq sequences share one cache of n_seq·ctx cells (--parallel)."""
    f = fill.copy()
    ctx_pad = -(-ctx * n_seq // CTX_PAD) * CTX_PAD
    per_dev = [0] * len(devices)
    parts = {"weights_bytes": 0, "kv_bytes": 0, "compute_bytes": 0}
    charged: set[int] = set()
    d = 0
    local_only = which == "draft"
    for weights, kv, is_output in _items(shape, ngl, ctx_pad, cache_type, which, n_seq):
        while True:
            while local_only and d < len(devices) and devices[d].endpoint:
                d += 1
            if d >= len(devices):
                return None
            need = weights + kv
            compute = 0
            if d not in charged:
                compute += shape.compute_bytes(ctx_pad, False, flash_attn)
            if is_output:
                compute += 4 * N_UBATCH * shape.n_vocab
            if f.used[d] + need + compute <= devices[d].budget_bytes:
                break
            d += 1
        f.used[d] += need + compute
        charged.add(d)
        per_dev[d] += 1
        parts["weights_bytes"] += weights
        parts["kv_bytes"] += kv
        parts["compute_bytes"] += compute
    f.layers[which] = per_dev
    f.parts[which] = parts
    return f


def _place_pair(devices, target, draft, ctx, cache_type, flash_attn, ngl_target, n_seq=1):
    base = _Fill([dv.reserve_bytes for dv in devices])
    if any(u > dv.budget_bytes for u, dv in zip(base.used, devices)):
        return None
    if draft is not None and any(not dv.endpoint for dv in devices):  # no local GPU: the draft runs on the CPU
        base = _place(base, devices, "draft", draft, draft.n_layer + 1, ctx, cache_type, flash_attn, n_seq)
        if base is None:
            return None
    return _place(base, devices, "target", target, ngl_target, ctx, cache_type, flash_attn, n_seq)


@dataclass(frozen=True)
class Plan:
    fits: bool
    full_offload: bool
    ctx: int
    cache_type: str
    flash_attn: bool
    devices: tuple[Device, ...]
    target: ModelShape
    draft: ModelShape | None
    ngl: int
    ngl_draft: int
    fill: _Fill | None = field(repr=False, default=None)
    reason: str = ""
    parallel: int = 1  # sequences whose KV caches the plan holds (ctx tokens each)

    @property
    def budget_bytes(self) -> int:
        return sum(d.budget_bytes for d in self.devices)

    @property
    def total_bytes(self) -> int:
        return sum(self.fill.used) if self.fill else 0

    def tensor_split(self, which: str) -> list[float]:
        """llama.cpp `tensor_split` proportions that reproduce this plan's layers per device."""
        if not self.fill or which not in self.fill.layers:
            return []
        return [float(n) for n in self.fill.layers[which]]

    def _model(self, which: str, shape: ModelShape, ngl: int) -> dict:
        parts = (self.fill.parts.get(which) if self.fill else None) or {}
        return {
            "path": shape.path, "n_layers": shape.n_layer, "ngl": ngl, "ngl_max": shape.n_layer + 1,
            "weights_bytes": parts.get("weights_bytes", 0), "kv_bytes": parts.get("kv_bytes", 0),
            "compute_bytes": parts.get("compute_bytes", 0), "model_bytes": shape.weights_bytes,
            "kv_bytes_per_token": sum(shape.kv_per_token(i, self.cache_type) for i in range(shape.n_layer)),
            # included in kv_bytes (for the offloaded layers): hybrid layers' recurrent state, all copies
            "recurrent_bytes": sum(shape.state_bytes) * shape.state_copies(which),
            "n_ctx_train": shape.n_ctx_train,
        }

    def to_dict(self) -> dict:
        devs = []
        for i, d in enumerate(self.devices):
            devs.append({
                "name": d.name, "budget_bytes": d.budget_bytes, "reserve_bytes": d.reserve_bytes,
                "endpoint": d.endpoint,
                "bytes": self.fill.used[i] if self.fill else 0,
                "target_layers": self.fill.layers.get("target", [0] * len(self.devices))[i] if self.fill else 0,
                "draft_layers": self.fill.layers.get("draft", [0] * len(self.devices))[i] if self.fill else 0,
            })
        return {
            "fits": self.fits, "full_offload": self.full_offload, "ctx": self.ctx, "parallel": self.parallel,
            "cache_type": self.cache_type,
            "flash_attn": self.flash_attn, "budget_bytes": self.budget_bytes, "total_bytes": self.total_bytes,
            "target": self._model("target", self.target, self.ngl),
            "draft": self._model("draft", self.draft, self.ngl_draft) if self.draft else None,
            "devices": devs,
            "tensor_split": {"target": self.tensor_split("target"), "draft": self.tensor_split("draft")},
            "reason": self.reason,
        }


def _draft_refusal(devices, draft: ModelShape, ctx: int, cache_type: str, flash_attn: bool) -> str:
    ctx_pad = -(-ctx // CTX_PAD) * CTX_PAD
    w = sum(draft.layer_bytes) + draft.output_bytes
    kv = sum(draft.layer_memory(i, ctx_pad, cache_type, "draft") for i in range(draft.n_layer))
    comp = draft.compute_bytes(ctx_pad, True, flash_attn)
    reserve = sum(d.reserve_bytes for d in devices)
    budget = sum(d.budget_bytes for d in devices)
    return (f"the draft alone does not fit in the VRAM budget (draft needs {fmt_bytes(w + kv + comp + reserve)} "
            f"at ctx {ctx}: {fmt_bytes(w)} weights, {fmt_bytes(kv)} KV cache, {fmt_bytes(comp)} compute, "
            f"{fmt_bytes(reserve)} reserve; budget {fmt_bytes(budget)}); "
            "give more VRAM, a smaller --ctx, a q8_0 KV cache or a smaller draft quant")


def plan(target: str | ModelShape, draft: str | ModelShape | None, devices: Sequence[Device],
         ctx: int | None = None, cache_type: str = "f16", flash_attn: bool = True, parallel: int = 1) -> Plan:
    """Place the draft fully, then as many target layers as fit; with ctx=None, the largest context
    (a multiple of 256, up to both models' context_length) at which both fit fully, else DEFAULT_CTX.
    `parallel`: sequences held at once, ctx tokens each (`serve --parallel`): their KV caches and states.
    Never raises for a budget that is too small: the Plan says fits=False with the reason."""
    if parallel < 1:
        raise UsageError(f"--parallel must be at least 1 ({parallel})")
    if cache_type not in CACHE_TYPES:
        raise UsageError(f"unknown KV cache type ({cache_type}); use one of {', '.join(CACHE_TYPES)}")
    if not devices:
        raise UsageError("no device budget given; pass --vram like 24GiB or 24GiB,24GiB")
    if ctx is not None and ctx < 16:
        raise UsageError(f"--ctx must be at least 16 ({ctx})")
    t = target if isinstance(target, ModelShape) else model_shape(target)
    d = draft if isinstance(draft, ModelShape) or draft is None else model_shape(draft)
    devices = tuple(devices)
    full = t.n_layer + 1
    cap = min(t.n_ctx_train, d.n_ctx_train) if d else t.n_ctx_train

    def fill_at(c: int, ngl: int):
        return _place_pair(devices, t, d, c, cache_type, flash_attn, ngl, parallel)

    if ctx is None:
        c0 = min(DEFAULT_CTX, cap)
        if fill_at(c0, full) is not None:
            # Largest context with everything on the GPU: binary search over multiples of CTX_PAD
            # (c0 is DEFAULT_CTX, a multiple of CTX_PAD, unless cap itself is smaller).
            if fill_at(cap, full) is not None:
                ctx = cap
            else:
                lo_k, hi_k = c0 // CTX_PAD, -(-cap // CTX_PAD)  # fits at lo_k·PAD, not at hi_k·PAD
                while hi_k - lo_k > 1:
                    mid = (lo_k + hi_k) // 2
                    if fill_at(mid * CTX_PAD, full) is not None:
                        lo_k = mid
                    else:
                        hi_k = mid
                ctx = lo_k * CTX_PAD
        else:
            ctx = c0

    if d is not None and fill_at(ctx, 0) is None:
        return Plan(False, False, ctx, cache_type, flash_attn, devices, t, d, 0, 0, None,
                    _draft_refusal(devices, d, ctx, cache_type, flash_attn), parallel)
    best = None
    for ngl in range(full, -1, -1):
        best = fill_at(ctx, ngl)
        if best is not None:
            break
    if best is None:  # no draft and not even zero layers: the reserve alone exceeds the budget
        return Plan(False, False, ctx, cache_type, flash_attn, devices, t, d, 0, 0, None,
                    f"the VRAM budget ({fmt_bytes(sum(x.budget_bytes for x in devices))}) is smaller than the "
                    f"per-device reserve; give more VRAM", parallel)
    draft_local = d is not None and any(not dv.endpoint for dv in devices)
    ngl_draft = d.n_layer + 1 if draft_local else 0
    full_off = ngl == full
    parts = [f"draft fully on the GPU ({ngl_draft}/{ngl_draft} layers)"] if draft_local else []
    if d is not None and not draft_local:
        parts.append("draft on this machine's CPU (no local GPU beside the RPC devices)")
    if full_off:
        parts.append(f"target fully on the GPU ({ngl}/{full} layers)")
    elif ngl == 0:
        parts.append(f"target entirely on the CPU (0/{full} layers fit; it will be slow)")
    else:
        parts.append(f"target partly offloaded ({ngl}/{full} layers on the GPU, the rest run on the CPU)")
    parts.append(f"ctx {ctx}" + (f" for each of {parallel} sequences" if parallel > 1 else ""))
    reason = "; ".join(parts)
    return Plan(True, full_off, ctx, cache_type, flash_attn, devices, t, d, ngl, ngl_draft, best, reason, parallel)


# ---- the entry point bench/chat use for --vram-budget ----------------------------------------
def budget_devices(budget: str | float | int | Sequence[int], reserve_bytes: int | None = None) -> list[Device]:
    """Turn a budget into devices: a fraction of each GPU's free memory (asks llama.cpp for the GPUs),
    or absolute sizes per device (GPU0, GPU1, ...; RESERVE_BYTES kept free on each)."""
    if isinstance(budget, str):
        budget = parse_budget(budget)
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0:
            raise UsageError(f"a VRAM fraction must be in (0, 1] ({budget})")
        from ..llama import ffi as _ffi

        remote = _remote_devices(budget, reserve_bytes or 0)
        gpus = [g for g in _ffi.devices() if g.type in ("GPU", "IGPU") and g.name not in {r.name for r in remote}]
        if not gpus and not remote:
            raise PlanError("a VRAM budget needs a GPU, but this llama.cpp build lists none (CPU-only build, or "
                            "no usable driver); run `specq doctor`, or drop the budget")
        return remote + [Device(g.name, int(g.memory_free * budget), reserve_bytes or 0) for g in gpus]
    sizes = [budget] if isinstance(budget, int) else list(budget)
    reserve = RESERVE_BYTES if reserve_bytes is None else reserve_bytes
    return _remote_devices(1.0, reserve) + [Device(f"GPU{i}", int(s), reserve) for i, s in enumerate(sizes)]


def _remote_devices(fraction: float, reserve: int) -> list[Device]:
    """The RPC devices added with --rpc, first as llama.cpp orders them, sized by what their servers report."""
    from ..llama import ffi as _ffi
    from . import rpc

    remote = rpc.remote_devices()
    if not remote:
        return []
    return [Device(g.name, int(g.memory_free * fraction), reserve, remote[g.name])
            for g in _ffi.devices() if g.name in remote]


def choose_layers(target_path: str, draft_path: str | None, budget: str | float | int | Sequence[int],
                  ctx: int | None, cache_type: str = "f16") -> tuple[int, int, Plan]:
    """(ngl, ngl_draft, plan) for `--vram-budget`; raises PlanError when not even the draft fits."""
    p = plan(target_path, draft_path, budget_devices(budget), ctx=ctx, cache_type=cache_type)
    if not p.fits:
        raise PlanError(p.reason)
    if not p.full_offload:
        log.warning("VRAM budget: %s", p.reason)
    return p.ngl, p.ngl_draft, p
