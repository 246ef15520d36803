"""The one boundary between specq and llama.cpp's C API (llama-cpp-python's `llama_cpp.llama_cpp`).

Every ctypes handle lives in a class here with `close()` and a context manager; every C return code
is checked and raised as a specq exception carrying the values. The rest of specq calls this module.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from pathlib import Path
from typing import Callable

import numpy as np

import llama_cpp.llama_cpp as C

from ...errors import ContextFullError, LlamaCallError, ModelFileError, SpecqError, UsageError, check_text
from . import abort_guard
from . import held as H
from .gguf_check import check_model_file
from .interrupts import deferred_sigint

log = logging.getLogger("specq.native")
llama_log = logging.getLogger("specq.llama")

GGUF_MAGIC = b"GGUF"
# ggml_log_level: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (continues the previous line)
_LEVELS = {0: logging.CRITICAL, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_backend_ready = False
_last_level = logging.DEBUG


@C.llama_log_callback
def _route_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    # llama.cpp logs go to Python logging; the CLI shows them only with --verbose.
    global _last_level
    lvl = _last_level if level == 5 else _LEVELS.get(level, logging.DEBUG)
    _last_level = lvl
    if llama_log.isEnabledFor(lvl):
        llama_log.log(lvl, "%s", text.decode("utf-8", "replace").rstrip("\n"))


class CallClock:
    """When the llama.cpp call now running began (None: none), for native/commands/rpc.py's watchdog; off unless enabled."""

    __slots__ = ("since", "what", "enabled")

    def __init__(self):
        self.since, self.what, self.enabled = None, "", False

    def __call__(self, what: str) -> "CallClock":
        self.what = what
        return self

    def __enter__(self) -> None:
        if self.enabled:
            self.since = time.monotonic()

    def __exit__(self, *exc) -> None:
        self.since = None

    def tick(self) -> None:
        """Progress inside a long call (a model load over the network)."""
        if self.since is not None:
            self.since = time.monotonic()


call_clock = CallClock()


@C.llama_progress_callback
def _load_progress(progress: float, _user: ctypes.c_void_p) -> bool:
    call_clock.tick()
    return True


def ensure_backend() -> None:
    """Initialise llama.cpp once per process and route its log through `logging`."""
    global _backend_ready
    if _backend_ready:
        return
    C.llama_log_set(_route_log, ctypes.c_void_p(0))
    C.llama_backend_init()
    abort_guard.install()
    _backend_ready = True


def llama_cpp_python_version() -> str:
    import llama_cpp

    return getattr(llama_cpp, "__version__", "unknown")


def system_info() -> str:
    ensure_backend()
    return C.llama_print_system_info().decode("utf-8", "replace").strip()


def supports_gpu_offload() -> bool:
    ensure_backend()
    return bool(C.llama_supports_gpu_offload())


class _BuftOverride(ctypes.Structure):
    # struct llama_model_tensor_buft_override (the bindings declare the params field as a void pointer)
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


_cpu_policies: dict = {}


def cpu_policy(allow_amx: bool = False):
    """This machine's CPU weight-buffer policy (native/llama/cpu.py), decided once per process."""
    from . import cpu

    if allow_amx not in _cpu_policies:
        _cpu_policies[allow_amx] = cpu.decide(system_info(), cpu.cpu_flags(), allow_amx,
                                              repack_available="CPU_REPACK" in cpu_extra_buffer_types())
    return _cpu_policies[allow_amx]


def check_gguf_file(path: str | os.PathLike) -> Path:
    """Raise ModelFileError unless `path` is an existing, non-empty GGUF file."""
    p = Path(path)
    if not p.exists():
        raise ModelFileError(f"model file not found ({p}); check the path")
    if not p.is_file():
        raise ModelFileError(f"model path is not a file ({p}); pass a .gguf file")
    with p.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"not a GGUF file ({p}); convert it with `specq convert` first")
    check_model_file(p)  # what llama.cpp would abort on or refuse, named in Python first
    return p


class _Handle:
    """Deterministic lifetime for one C handle: close(), a context manager, and close on garbage collection."""

    _h = None

    def _free(self, handle) -> None:
        raise NotImplementedError

    def close(self) -> None:
        if self._h is not None:
            h, self._h = self._h, None
            self._free(h)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        self.close()


class Model(_Handle):
    """A loaded GGUF model (weights and vocabulary)."""

    def __init__(self, path: str | os.PathLike, n_gpu_layers: int = 0, vocab_only: bool = False,
                 main_gpu: int = 0, tensor_split: list[float] | None = None, devices: list[str] | None = None,
                 cpu_amx: bool = False, cpu_buffers=None, load_mtp: bool = False):
        """`cpu_buffers`: a native.cpu.CpuPolicy to apply instead of this machine's (tests, benchmarks).
        `load_mtp`: also load the target's NextN/MTP block(s), which llama.cpp skips by default."""
        ensure_backend()
        self.path = check_gguf_file(path)
        params = C.llama_model_default_params()
        params.n_gpu_layers = int(n_gpu_layers)
        params.load_mtp = bool(load_mtp)
        params.vocab_only = bool(vocab_only)
        params.main_gpu = int(main_gpu)
        self._split = self._devs = self._overrides = None  # kept alive while llama.cpp may read them
        # Never a configuration known to crash (native/llama/cpu.py): the AMX buffer stays off unless asked for.
        self.cpu_policy = cpu_buffers or cpu_policy(allow_amx=cpu_amx)
        self.n_repacked = 0  # weight patterns sent to the CPU-repack buffer by name ("amx-off")
        self.n_amx_f16 = 0  # F16 weight patterns sent to the AMX buffer's AVX-512 path ("amx-off")
        if not self.cpu_policy.use_extra_bufts:
            params.use_extra_bufts = False
            all_cpu = n_gpu_layers == 0 or not supports_gpu_offload() or devices == []
            if self.cpu_policy.extra_buffers == "amx-off" and all_cpu and not vocab_only and devices in (None, [], ["CPU"]):
                self._set_repack_overrides(params)
        if tensor_split:
            n = C.llama_max_devices()
            arr = (ctypes.c_float * n)(*(list(tensor_split) + [0.0] * n)[:n])
            self._split = arr
            params.tensor_split = arr
        if devices is not None:  # [] → no device: the CPU only (the draft beside remote RPC devices)
            self._devs = device_handles(devices)
            params.devices = ctypes.cast(self._devs, ctypes.c_void_p).value
        if call_clock.enabled:
            params.progress_callback = _load_progress
        with deferred_sigint(), call_clock(f"loading {self.path.name}"):
            # a Ctrl-C inside the log callback would be swallowed: raise it after the load
            handle = self._h = C.llama_model_load_from_file(str(self.path).encode(), params) or None
        if not handle:
            raise ModelFileError(
                f"llama.cpp could not load the model ({self.path}); the file may be truncated or corrupt, "
                "or of an architecture this llama.cpp does not know (run with -v for llama.cpp's log)")
        self._h = handle
        self.vocab = C.llama_model_get_vocab(handle)
        self.n_vocab = int(C.llama_vocab_n_tokens(self.vocab))
        self._pieces: dict[int, bytes] = {}

    def _set_repack_overrides(self, params) -> None:
        """amx-off: weights the CPU-repack kernels take go to that buffer, F16 weights to the AMX buffer's
        AVX-512 path (cpu.amx_f16_patterns), by name; every other weight stays in plain CPU memory."""
        from .cpu import amx_f16_patterns, repack_patterns, system_info_flag
        from .gguf_header import read_header

        bufts = cpu_extra_buffer_types()
        tensors = [(t.name, t.shape, t.ggml_type) for t in read_header(self.path).tensors]
        chosen = []
        if bufts.get("CPU_REPACK"):
            chosen += [(p, bufts["CPU_REPACK"]) for p in repack_patterns(tensors,
                                                                         avx2=system_info_flag(system_info(), "AVX2"))]
        self.n_repacked = len(chosen)
        if bufts.get("AMX"):
            chosen += [(p, bufts["AMX"]) for p in amx_f16_patterns(tensors)]
        self.n_amx_f16 = len(chosen) - self.n_repacked
        if not chosen:
            return
        arr = (_BuftOverride * (len(chosen) + 1))()
        for i, (pat, buft) in enumerate(chosen):
            arr[i].pattern, arr[i].buft = pat.encode(), buft
        self._overrides = arr
        params.tensor_buft_overrides = ctypes.cast(arr, ctypes.c_void_p).value

    # -- lifetime ---------------------------------------------------------------------------
    @property
    def handle(self):
        if self._h is None:
            raise SpecqError("model is closed")
        return self._h

    def _free(self, handle) -> None:
        C.llama_model_free(handle)

    # -- metadata ---------------------------------------------------------------------------
    @property
    def n_layer(self) -> int:
        return int(C.llama_model_n_layer(self.handle))

    @property
    def n_layer_nextn(self) -> int:
        """NextN/MTP blocks after the trunk (0: the model cannot draft for itself)."""
        return int(C.llama_model_n_layer_nextn(self.handle))

    @property
    def n_embd_out(self) -> int:
        return int(C.llama_model_n_embd_out(self.handle))

    @property
    def n_params(self) -> int:
        return int(C.llama_model_n_params(self.handle))

    @property
    def size_bytes(self) -> int:
        return int(C.llama_model_size(self.handle))

    def attention_per_context_token(self) -> float:
        """A decoded token's attention arithmetic per token of context, as a share of its weights' arithmetic:
        4 · (attention layers) · n_head · head_dim against 2 · n_params (the cost model's prior for how much of
        a step grows with the context). Hybrid models count their full-attention layers only; sliding-window
        layers count as full ones (an overestimate past the window)."""
        arch = self.meta("general.architecture") or ""
        n_layer = self.n_layer
        interval = self.meta(f"{arch}.full_attention_interval")
        if interval and interval.isdigit() and int(interval) > 0:
            n_layer = max(n_layer // int(interval), 1)
        elif self.is_recurrent_or_hybrid:
            n_layer = max(n_layer // 4, 1)
        n_head = int(C.llama_model_n_head(self.handle))
        key_length = self.meta(f"{arch}.attention.key_length")
        head_dim = int(key_length) if key_length and key_length.isdigit() else \
            int(C.llama_model_n_embd(self.handle)) // max(n_head, 1)
        return 4.0 * n_layer * n_head * head_dim / max(2.0 * self.n_params, 1.0)

    @property
    def n_ctx_train(self) -> int:
        return int(C.llama_model_n_ctx_train(self.handle))

    @property
    def n_swa(self) -> int:
        """The sliding window of its sliding-window layers (0: none)."""
        return int(C.llama_model_n_swa(self.handle))

    @property
    def is_recurrent_or_hybrid(self) -> bool:
        return bool(C.llama_model_is_recurrent(self.handle)) or bool(C.llama_model_is_hybrid(self.handle))

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = C.llama_model_meta_val_str(self.handle, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            C.llama_model_meta_val_str(self.handle, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    def chat_template(self) -> str | None:
        t = C.llama_model_chat_template(self.handle, None)
        return t.decode("utf-8", "replace") if t else None

    # -- vocabulary -------------------------------------------------------------------------
    @property
    def vocab_type(self) -> int:
        return int(C.llama_vocab_type(self.vocab))

    @property
    def bos(self) -> int:
        return int(C.llama_vocab_bos(self.vocab))

    @property
    def eos(self) -> int:
        return int(C.llama_vocab_eos(self.vocab))

    @property
    def add_bos(self) -> bool:
        return bool(C.llama_vocab_get_add_bos(self.vocab))

    @property
    def add_eos(self) -> bool:
        return bool(C.llama_vocab_get_add_eos(self.vocab))

    def token_text(self, token: int) -> bytes:
        return C.llama_vocab_get_text(self.vocab, token) or b""

    def is_eog(self, token: int) -> bool:
        return bool(H.llama_vocab_is_eog(self.vocab, token))

    def text_tokens(self) -> np.ndarray:
        """Which token ids are text by their llama.cpp attributes: normal, byte and user-defined tokens, never
        control, unknown or unused ones."""
        text = C.LLAMA_TOKEN_ATTR_NORMAL | C.LLAMA_TOKEN_ATTR_BYTE | C.LLAMA_TOKEN_ATTR_USER_DEFINED
        other = C.LLAMA_TOKEN_ATTR_CONTROL | C.LLAMA_TOKEN_ATTR_UNKNOWN | C.LLAMA_TOKEN_ATTR_UNUSED
        attrs = np.array([C.llama_vocab_get_attr(self.vocab, i) for i in range(self.n_vocab)], dtype=np.int64)
        return ((attrs & text) != 0) & ((attrs & other) == 0)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = check_text(text, "the text to tokenize").encode("utf-8")
        cap = len(data) + 8
        buf = (C.llama_token * cap)()
        n = C.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (C.llama_token * cap)()
            n = C.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            raise LlamaCallError("llama_tokenize", n, f"text of {len(data)} bytes")
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """The bytes a token renders as (special tokens rendered), cached per model."""
        p = self._pieces.get(token)
        if p is None:
            buf = ctypes.create_string_buffer(64)
            n = H.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = H.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
            p = buf.raw[:max(n, 0)]
            self._pieces[token] = p
        return p

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", "replace")


FLASH_ATTN = {"auto": C.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": C.LLAMA_FLASH_ATTN_TYPE_ENABLED,
              "off": C.LLAMA_FLASH_ATTN_TYPE_DISABLED}


class CacheMemory:
    """A Context's memory (KV cache / recurrent state) by sequence: remove and copy positions, the positions
    held, clear, and save or restore a sequence's state."""

    def seq_rm(self, p0: int, p1: int = -1, seq: int = 0) -> bool:
        """Remove positions [p0, p1) of the sequence; False where the memory cannot remove part of it."""
        return bool(H.llama_memory_seq_rm(self._mem, seq, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Make sequence dst also hold src's positions [p0, p1) (one unified cache: no data is copied)."""
        C.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    def pos_max(self, seq: int = 0) -> int:
        return int(H.llama_memory_seq_pos_max(self._mem, seq))

    def pos_min(self, seq: int = 0) -> int:
        """The oldest position the memory still holds (-1 when empty); > 0 once a sliding window has slid."""
        return int(H.llama_memory_seq_pos_min(self._mem, seq))

    def window_intact(self, n: int, seq: int = 0) -> bool:
        """Whether the memory still holds every position a token at position n attends to, so that keeping
        positions < n and decoding from n is exact. A sliding-window cache reuses the cells of positions that
        left the window; llama.cpp's seq_rm reports success even when the cells n needs are gone (llama-server
        makes the same check, pos_min against pos - n_swa, before reusing a cached prompt)."""
        return self.n_swa == 0 or self.pos_min(seq) <= max(0, n - self.n_swa)

    def clear(self, seq: int | None = None) -> None:
        """Empty the memory (None: every sequence), or one sequence's part of it."""
        if seq is None or self.n_seq == 1:
            C.llama_memory_clear(self._mem, True)
        else:
            C.llama_memory_seq_rm(self._mem, seq, -1, -1)

    def state_get(self, partial: bool = True, seq: int = 0) -> bytes:
        flags = C.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY if partial else 0
        size = C.llama_state_seq_get_size_ext(self.handle, seq, flags)
        buf = (ctypes.c_uint8 * size)()
        n = C.llama_state_seq_get_data_ext(self.handle, buf, size, seq, flags)
        if n != size:
            raise LlamaCallError("llama_state_seq_get_data_ext", int(n), f"{self.name}: expected {size} bytes")
        return bytes(buf)

    def state_set(self, data: bytes, partial: bool = True, seq: int = 0) -> None:
        flags = C.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY if partial else 0
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        n = C.llama_state_seq_set_data_ext(self.handle, buf, len(data), seq, flags)
        if n == 0:
            raise LlamaCallError("llama_state_seq_set_data_ext", 0, f"{self.name}: {len(data)} bytes not restored")


class Context(CacheMemory, _Handle):
    """A llama.cpp context (the KV cache / recurrent state of its sequences) over a Model. Methods that touch one
    sequence take `seq` (default 0); `seq(i)` is a view of sequence i that speaks like a one-sequence Context."""

    def __init__(self, model: Model, n_ctx: int, n_threads: int, n_batch: int = 512,
                 n_outputs_max: int = 0, name: str = "model", n_rs_seq: int = 0, flash_attn: str = "auto",
                 swa_full: bool = False, n_seq: int = 1, unified: bool | None = None):
        """`n_rs_seq`: recurrent-state snapshots kept for rolling back the tail of the last decode without a
        checkpoint (llama.cpp's experimental n_rs_seq; 0 where the architecture does not support it).
        `flash_attn`: "on", "off" or "auto" (llama.cpp's choice: on where the device supports it).
        `swa_full`: give sliding-window layers a full-size cache (llama.cpp's default) instead of one that keeps
        about window + n_ubatch positions; specq keeps the small one and checks each rollback (`window_intact`).
        `n_seq`: sequences held at once, n_ctx cells each: in one unified cache (a batch of any rows is one ubatch)
        or, `unified` False, a stream each (equal-length ubatches; config.kv_streams, benchmarks/kv_layout.py)."""
        self.model = model
        self.name = name
        params = C.llama_context_default_params()
        params.n_ctx = int(n_ctx) * int(n_seq)
        params.n_batch = int(n_batch)
        params.n_ubatch = int(n_batch)
        params.n_seq_max = int(n_seq)
        params.kv_unified = n_seq > 1 if unified is None else unified
        params.n_threads = int(n_threads)
        params.n_threads_batch = int(n_threads)
        params.n_outputs_max = int(n_outputs_max)
        params.n_outputs_max_per_seq = 0  # only limits backend sampling, which specq does not use
        params.n_rs_seq = int(n_rs_seq)
        params.flash_attn_type = FLASH_ATTN[flash_attn]
        params.swa_full = bool(swa_full)
        params.no_perf = True
        with call_clock(f"creating the {name} context"):
            handle = C.llama_init_from_model(model.handle, params)
        if not handle:
            raise SpecqError(f"llama.cpp could not create a context for {model.path} (n_ctx={n_ctx}); "
                             "try a smaller --ctx or fewer GPU layers")
        self._h = handle
        self.n_seq = int(n_seq)
        self.unified = bool(params.kv_unified) or self.n_seq == 1  # False: a stream per sequence
        self.n_padding_rows = 0  # rows decoded for idle sequences between busy ones (separate streams)
        self.n_ctx = int(C.llama_n_ctx(handle)) // self.n_seq  # one sequence's
        self.n_batch = int(C.llama_n_batch(handle))
        self.n_vocab = model.n_vocab
        self._mem = C.llama_get_memory(handle)
        self._batch = C.llama_batch_init(self.n_batch, 0, 1)
        b = self._batch
        self._seq_ids = np.zeros(self.n_batch, np.int32)  # what the batch's seq_id[i][0] hold now
        self._seq_want = np.zeros(self.n_batch, np.int32)
        self._tok = np.ctypeslib.as_array(b.token, shape=(self.n_batch,))
        self._pos = np.ctypeslib.as_array(b.pos, shape=(self.n_batch,))
        self._out = np.ctypeslib.as_array(b.logits, shape=(self.n_batch,))
        nseq = np.ctypeslib.as_array(b.n_seq_id, shape=(self.n_batch,))
        nseq[:] = 1
        for i in range(self.n_batch):
            b.seq_id[i][0] = 0
        self.n_outputs = 0
        self.decode_s = 0.0  # wall time spent inside llama_decode, for overhead accounting
        self.n_decode_calls = 0
        self.n_rs_seq = int(C.llama_n_rs_seq(handle))  # what llama.cpp granted (clamped to 0 if unsupported)
        self._last_pos0 = {0: 0}  # each sequence's first position in its last llama_decode (rollback snapshots)
        self._out_row = {0: 0}  # each sequence's first output row in the last llama_decode
        self._out_at = {0: 0}  # and that row's index in the batch (what llama.cpp's samplers take)
        self.n_multi_decodes = 0  # decodes that carried rows of two or more sequences
        self.max_seqs_per_decode = 1
        self.n_swa = 0 if swa_full else model.n_swa  # the window of layers that may drop old positions (0: none)
        self.on_decode = None  # called as on_decode(name, n_tokens, pos0) after each llama_decode (simulated clocks)
        self._hidden_sinks: dict[int, Callable] = {}  # output_hidden(): seq → on_hidden(pos0, rows) after a decode
        self.n_outputs_max = int(n_outputs_max)
        self.n_warm_up_decodes = 0

    def warm_up(self) -> None:
        """Decode a 2-token batch and a single token, then empty the cache: a fresh context's first decodes pay
        one-time costs (pages touched, threads started) that would make the controller's first estimates too dear."""
        bos = self.model.bos
        tok = bos if 0 <= bos < self.n_vocab else 0
        self.decode([tok, tok], 0, logits="all" if self.n_outputs_max == 0 or self.n_outputs_max >= 2 else "last")
        self.decode([tok], 2, logits="last")
        self.n_warm_up_decodes = self.n_decode_calls
        self.clear()
        self.decode_s, self.n_decode_calls, self.n_outputs = 0.0, 0, 0
        self._last_pos0 = {0: 0}
        self.n_multi_decodes, self.max_seqs_per_decode = 0, 1

    @property
    def last_decode_pos0(self) -> int:
        """Sequence 0's first position in its last llama_decode (rollback snapshots cover only that decode)."""
        return self._last_pos0.get(0, 0)

    def seq(self, seq: int) -> "SeqContext":
        """A view of sequence `seq` that speaks like a one-sequence Context (Memory holds one)."""
        if not 0 <= seq < self.n_seq:
            raise ValueError(f"{self.name}: sequence {seq} of {self.n_seq}")
        return SeqContext(self, seq)

    def output_hidden(self, on_hidden, seq: int = 0) -> None:
        """After each decode, hand the trunk's last hidden state of every batch position of sequence `seq` (the
        MTP head's input, n_embd floats a row, no extra logits rows) to on_hidden(pos0, rows): a view valid during
        the call. None stops it for that sequence; the output is on while any sequence has one."""
        from llama_cpp import llama_cpp_ext as X

        was = bool(self._hidden_sinks)
        if on_hidden is None:
            self._hidden_sinks.pop(seq, None)
        else:
            self._hidden_sinks[seq] = on_hidden
        if bool(self._hidden_sinks) != was:  # unmasked: a row per token, logits or not
            X.llama_set_embeddings_nextn(self.handle, bool(self._hidden_sinks), False)
        self._n_embd = self.model.n_embd_out

    def hidden_sink(self, seq: int = 0):
        """What output_hidden gave sequence `seq` (None: nothing)."""
        return self._hidden_sinks.get(seq)

    @property
    def handle(self):
        if self._h is None:
            raise SpecqError(f"{self.name} context is closed")
        return self._h

    def _free(self, handle) -> None:
        C.llama_batch_free(self._batch)
        C.llama_free(handle)

    def decode(self, tokens, pos0: int, logits: str = "last", seq: int = 0) -> None:
        """Evaluate `tokens` at positions pos0.. of sequence `seq`; logits: "last", "all" or "none".

        Batches longer than n_batch are split (a prefill); logits="all" must fit in one batch, since only
        one chunk's outputs can be read back.
        """
        n = len(tokens)
        if n == 0:
            return
        if logits == "all" and n > self.n_batch:
            raise SpecqError(f"{self.name}: {n} tokens with logits for all exceed the batch size ({self.n_batch}); "
                             "this is a bug in the caller")
        if pos0 + n > self.n_ctx:
            raise ContextFullError(
                f"{self.name} context is full ({pos0 + n} tokens > ctx {self.n_ctx}); use a larger --ctx")
        start = 0
        while start < n:
            m = min(self.n_batch, n - start)
            final = start + m == n
            self._tok[:m] = tokens[start:start + m]
            self._pos[:m] = np.arange(pos0 + start, pos0 + start + m, dtype=np.int32)
            self._set_seqs(m, seq)
            self._out[:m] = 0
            if final and logits == "all":
                self._out[:m] = 1
            elif final and logits == "last":
                self._out[m - 1] = 1
            self._last_pos0[seq] = pos0 + start
            self._out_row = {seq: 0}
            self._out_at = {seq: m - 1 if logits == "last" else 0}
            self._run(m, pos0 + start, f"{self.name}: batch of {m} at pos {pos0 + start}", [(seq, pos0 + start, m)])
            start += m
        self.n_outputs = (n - (start - m)) if logits == "all" else (1 if logits == "last" else 0)

    def decode_seqs(self, parts: list[tuple[int, list[int], int, str]]) -> None:
        """One llama_decode of several sequences' rows: parts (seq, tokens, pos0, logits "last"|"all"|"none"),
        each sequence once. Their output rows follow the parts' order; `logits(n, seq)` reads a sequence's."""
        parts, pads = padded(self, [p for p in parts if p[1]])
        m = sum(len(p[1]) for p in parts)
        if m > self.n_batch or len({p[0] for p in parts}) != len(parts):
            raise SpecqError(f"{self.name}: a batch of {m} rows over {len(parts)} sequences cannot be one decode "
                             f"(batch size {self.n_batch}); this is a bug in the caller")
        if m == 0:
            return
        i, row, outs, at = 0, 0, {}, {}
        for seq, tokens, pos0, logits in parts:
            n = len(tokens)
            if pos0 + n > self.n_ctx:
                raise ContextFullError(
                    f"{self.name} context is full ({pos0 + n} tokens > ctx {self.n_ctx}); use a larger --ctx")
            self._tok[i:i + n] = tokens
            self._pos[i:i + n] = np.arange(pos0, pos0 + n, dtype=np.int32)
            self._seq_want[i:i + n] = seq
            self._out[i:i + n] = 1 if logits == "all" else 0
            if logits == "last":
                self._out[i + n - 1] = 1
            outs[seq] = row
            at[seq] = i + n - 1 if logits == "last" else i
            row += n if logits == "all" else (1 if logits == "last" else 0)
            self._last_pos0[seq] = pos0
            i += n
        self._set_seqs(m, None)
        self._out_row, self._out_at = outs, at
        self.n_outputs = row
        if len(parts) >= 2:
            self.n_multi_decodes += 1
            self.max_seqs_per_decode = max(self.max_seqs_per_decode, len(parts))
        try:
            self._run(m, max(p[2] for p in parts), f"{self.name}: batch of {m} rows over {len(parts)} sequences",
                      [(seq, pos0, len(tokens)) for seq, tokens, pos0, _ in parts])
        finally:
            for seq, _, pos0, _ in pads:
                self.seq_rm(pos0, -1, seq)

    def _set_seqs(self, m: int, seq: int | None) -> None:
        """Point the batch's first m rows at their sequences (seq, or for None what _seq_want holds); only the
        rows that change are written (one C write each)."""
        want = self._seq_want[:m]
        if seq is not None:
            want[:] = seq
        b = self._batch
        for i in np.flatnonzero(self._seq_ids[:m] != want):
            b.seq_id[int(i)][0] = int(want[i])
        self._seq_ids[:m] = want

    def _run(self, m: int, pos0: int, what: str, spans: list[tuple[int, int, int]]) -> None:
        """llama_decode of the batch's first m rows, timed; its return code as an exception. `spans`: the rows'
        sequences in order, (seq, first position, rows) each, for the hidden-state sinks."""
        self._batch.n_tokens = m
        t0 = time.perf_counter()
        with call_clock(f"{self.name} decode"):
            rc = C.llama_decode(self.handle, self._batch)
            C.llama_synchronize(self.handle)  # the results waited for here, the GIL released (held.py)
        self.decode_s += time.perf_counter() - t0
        self.n_decode_calls += 1
        if self.on_decode is not None:
            self.on_decode(self.name, m, pos0)
        if rc == 0 and self._hidden_sinks:
            rows, i = self._hidden_rows(m), 0
            for seq, p0, n in spans:
                sink = self._hidden_sinks.get(seq)
                if sink is not None:
                    sink(p0, rows[i:i + n])
                i += n
        if rc != 0:
            if rc == 1:
                raise ContextFullError(
                    f"{self.name} context has no room for {m} more tokens (ctx {self.n_ctx}); use a larger --ctx")
            if rc == 2:
                raise KeyboardInterrupt
            raise LlamaCallError("llama_decode", rc, what)

    def output_index(self, i: int, seq: int = 0) -> int:
        """The batch index of a sequence's i-th output row in the last decode (where llama.cpp's samplers read
        it: with logits "last" the final row's)."""
        return self._out_at.get(seq, 0) + i

    def logits(self, n_rows: int | None = None, seq: int = 0) -> np.ndarray:
        """A read-only (n_rows, n_vocab) float32 view of the last decode's outputs (a sequence's rows, where it
        shared the decode with others; valid until the next decode)."""
        rows = self.n_outputs if n_rows is None else n_rows
        ptr = H.llama_get_logits(self.handle)  # the decode has synchronized
        if not ptr or rows <= 0:
            raise SpecqError(f"{self.name}: no logits available from the last decode")
        off = self._out_row.get(seq, 0)
        arr = np.ctypeslib.as_array(ptr, shape=(off + rows, self.n_vocab))[off:]
        arr.flags.writeable = False
        return arr

    def _hidden_rows(self, m: int) -> np.ndarray:
        from llama_cpp import llama_cpp_ext as X

        ptr = X.llama_get_embeddings_nextn(self.handle)
        if not ptr:
            raise SpecqError(f"{self.name}: llama.cpp gave no hidden states for the MTP head")
        return np.ctypeslib.as_array(ptr, shape=(m, self._n_embd))


class SeqContext:
    """One sequence of a multi-sequence Context, with a one-sequence Context's interface: what Memory, the
    drafters and the samplers call reach the parent with this sequence's id."""

    def __init__(self, parent: Context, seq: int):
        self.parent = parent
        self.seq = seq
        for name in ("model", "name", "n_ctx", "n_batch", "n_vocab", "n_rs_seq", "n_swa", "n_outputs_max"):
            setattr(self, name, getattr(parent, name))

    handle = property(lambda self: self.parent.handle)
    decode_s = property(lambda self: self.parent.decode_s)
    n_decode_calls = property(lambda self: self.parent.n_decode_calls)
    last_decode_pos0 = property(lambda self: self.parent._last_pos0.get(self.seq, 0))

    def decode(self, tokens, pos0: int, logits: str = "last") -> None:
        self.parent.decode(tokens, pos0, logits, seq=self.seq)

    def logits(self, n_rows: int | None = None) -> np.ndarray:
        return self.parent.logits(n_rows, seq=self.seq)

    def output_index(self, i: int) -> int:
        return self.parent.output_index(i, seq=self.seq)

    def seq_rm(self, p0: int, p1: int = -1) -> bool:
        return self.parent.seq_rm(p0, p1, seq=self.seq)

    def pos_max(self) -> int:
        return self.parent.pos_max(self.seq)

    def pos_min(self) -> int:
        return self.parent.pos_min(self.seq)

    def window_intact(self, n: int) -> bool:
        return self.parent.window_intact(n, seq=self.seq)

    def clear(self) -> None:
        self.parent.clear(seq=self.seq)

    def state_get(self, partial: bool = True) -> bytes:
        return self.parent.state_get(partial, seq=self.seq)

    def state_set(self, data: bytes, partial: bool = True) -> None:
        self.parent.state_set(data, partial, seq=self.seq)


Part = tuple[int, list[int], int, str]  # a sequence's rows in one decode: (seq, tokens, pos0, logits)


def padded(ctx: Context, parts: list[Part]) -> tuple[list[Part], list[Part]]:
    """The parts of a decode in sequence order, with padding_rows where the context keeps a stream per sequence;
    and those padding rows, to remove after the decode."""
    parts = sorted(parts, key=lambda p: p[0])
    pads = [] if ctx.unified else padding_rows(ctx, parts)
    return sorted(parts + pads, key=lambda p: p[0]), pads


def padding_rows(ctx: Context, parts: list[Part]) -> list[Part]:
    """With a stream per sequence llama.cpp puts into one ubatch only sequences whose ids follow each other
    (split_equal, sequential): one row for each idle sequence between busy ones keeps a step one pass over the
    weights. The row is removed after the decode; its stream is its own, so nothing else sees it. Its logits are
    kept, so that llama.cpp's samplers, which take a row's index in the batch, read the row output_index names."""
    busy = [p[0] for p in parts]
    if len(busy) < 2 or len({len(p[1]) for p in parts}) != 1:
        return []
    pads = []
    for seq in range(busy[0] + 1, busy[-1]):
        if seq not in busy:
            pos = ctx.pos_max(seq) + 1
            if pos + len(parts[0][1]) > ctx.n_ctx:  # no room for the rows: the decode splits instead
                return []
            pads.append((seq, [0] * len(parts[0][1]), pos, "all"))  # outputs: batch index = output row
    ctx.n_padding_rows += sum(len(p[1]) for p in pads)
    return pads


class MtpContext(_Handle):
    """llama.cpp's MTP context over a target loaded with load_mtp: the NextN block's own KV cache. Each position
    is fed a token and a hidden-state row (llama_batch_ext); the output row gives logits and the block's own
    hidden state, which feeds the next drafted position."""

    def __init__(self, model: Model, n_ctx: int, n_threads: int, n_batch: int = 512, n_seq: int = 1):
        """`n_seq`: sequences held at once (one per target sequence), n_ctx positions each, in one unified cache."""
        from llama_cpp import llama_cpp_ext as X

        self.model = model
        self.name = "mtp"
        if model.n_layer_nextn < 1:
            raise SpecqError(f"the target has no MTP layers ({model.path}); use --drafter model or ngram")
        params = C.llama_context_default_params()
        params.n_ctx = int(n_ctx) * int(n_seq)
        params.n_batch = params.n_ubatch = int(n_batch)
        params.n_seq_max = int(n_seq)
        params.kv_unified = n_seq > 1
        params.n_threads = params.n_threads_batch = int(n_threads)
        params.no_perf = True
        params.ctx_type = C.LLAMA_CONTEXT_TYPE_MTP
        handle = C.llama_init_from_model(model.handle, params)
        if not handle:
            raise SpecqError(f"llama.cpp could not create an MTP context for {model.path} (n_ctx={n_ctx}); "
                             "try a smaller --ctx, or --drafter model or ngram")
        self._h = handle
        # Unmasked: a state row per batch position. (Masked, qwen35's MTP graph copies the batch's first rows, not
        # the output rows: its state is taken before the output rows are selected.)
        X.llama_set_embeddings_nextn(handle, True, False)
        self.n_seq = int(n_seq)
        self.n_ctx = int(C.llama_n_ctx(handle)) // self.n_seq  # one sequence's
        self.n_batch = int(C.llama_n_batch(handle))
        self.n_vocab = model.n_vocab
        self.n_embd = model.n_embd_out
        self._mem = C.llama_get_memory(handle)
        self._batch = C.llama_batch_ext_init(handle)
        self._last_m = 0  # positions in the last llama_process call
        self.decode_s = 0.0
        self.n_decode_calls = 0
        self.on_decode = None

    @property
    def handle(self):
        if self._h is None:
            raise SpecqError("mtp context is closed")
        return self._h

    def _free(self, handle) -> None:
        C.llama_batch_ext_free(self._batch)
        C.llama_free(handle)

    def decode(self, tokens, pos0: int, hidden: np.ndarray, logits_last: bool, seq: int = 0) -> None:
        """Evaluate tokens[i] at position pos0+i of sequence `seq` paired with hidden[i] (float32 rows of n_embd);
        only the last position's logits and hidden state are output, and only when logits_last."""
        n = len(tokens)
        if hidden.shape != (n, self.n_embd):
            raise SpecqError(f"mtp: {n} tokens need {n} hidden rows of {self.n_embd} ({hidden.shape}); "
                             "this is a bug in the caller")
        if pos0 + n > self.n_ctx:
            raise ContextFullError(f"mtp context is full ({pos0 + n} tokens > ctx {self.n_ctx}); use a larger --ctx")
        hidden = np.ascontiguousarray(hidden, dtype=np.float32)
        h, b = self.handle, self._batch
        fptr = ctypes.POINTER(ctypes.c_float)
        for start in range(0, n, self.n_batch):
            m = min(self.n_batch, n - start)
            C.llama_batch_ext_clear(b)
            for i in range(start, start + m):
                idx = C.llama_batch_ext_add_token(b, int(seq), int(tokens[i]))
                pos = C.llama_pos(pos0 + i)
                row = hidden[i]
                ok = idx >= 0 and C.llama_batch_ext_set_pos(b, idx, ctypes.byref(pos)) and \
                    C.llama_batch_ext_set_embd_token(b, idx, C.llama_embd(row.ctypes.data_as(fptr), 1, self.n_embd)) \
                    and C.llama_batch_ext_set_output_logits(b, idx, logits_last and i == n - 1)
                if not ok:
                    raise LlamaCallError("llama_batch_ext_add_token", int(idx), f"mtp: token {i} of {n}")
            t0 = time.perf_counter()
            self._last_m = m
            rc = C.llama_process(h, C.LLAMA_PROCESS_TYPE_DECODE, b)
            self.decode_s += time.perf_counter() - t0
            self.n_decode_calls += 1
            if self.on_decode is not None:
                self.on_decode(self.name, m, pos0 + start)
            if rc == 2:
                raise KeyboardInterrupt
            if rc != 0:
                raise LlamaCallError("llama_process", rc, f"mtp: batch of {m} at pos {pos0 + start}")

    def logits(self) -> np.ndarray:
        """A read-only view of the last decode's output row (valid until the next decode)."""
        ptr = C.llama_get_logits_ith(self.handle, -1)
        if not ptr:
            raise SpecqError("mtp: no logits available from the last decode")
        arr = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        arr.flags.writeable = False
        return arr

    def hidden(self) -> np.ndarray:
        """A copy of the block's hidden state at the last decode's output row (the next position's input)."""
        from llama_cpp import llama_cpp_ext as X

        ptr = X.llama_get_embeddings_nextn_ith(self.handle, self._last_m - 1) if self._last_m else None
        if not ptr:
            raise SpecqError("mtp: no hidden state available from the last decode")
        return np.ctypeslib.as_array(ptr, shape=(self.n_embd,)).copy()

    def seq_rm(self, p0: int, p1: int = -1, seq: int = 0) -> bool:
        return bool(H.llama_memory_seq_rm(self._mem, int(seq), p0, p1))

    def pos_max(self, seq: int = 0) -> int:
        return int(H.llama_memory_seq_pos_max(self._mem, int(seq)))

    def clear(self, seq: int | None = None) -> None:
        """Empty one sequence's positions (None: the whole cache)."""
        if seq is None or self.n_seq == 1:
            C.llama_memory_clear(self._mem, True)
        else:
            C.llama_memory_seq_rm(self._mem, int(seq), 0, -1)


def _new_chain():
    sp = C.llama_sampler_chain_default_params()
    sp.no_perf = True
    return C.llama_sampler_chain_init(sp)


def _add_transform(chain, temp: float, top_k: int, top_p: float, min_p: float) -> None:
    """top-k → top-p → min-p → temp: the transform both models' distributions go through."""
    if top_k > 0:
        C.llama_sampler_chain_add(chain, C.llama_sampler_init_top_k(int(top_k)))
    if top_p < 1.0:
        C.llama_sampler_chain_add(chain, C.llama_sampler_init_top_p(float(top_p), 1))
    if min_p > 0.0:
        C.llama_sampler_chain_add(chain, C.llama_sampler_init_min_p(float(min_p), 1))
    C.llama_sampler_chain_add(chain, C.llama_sampler_init_temp(float(temp)))


class Sampler(_Handle):
    """llama.cpp's sampler chain for one model: greedy at temp 0, else top-k → top-p → min-p → temp → dist."""

    def __init__(self, temp: float, top_k: int, top_p: float, min_p: float, seed: int):
        self.greedy = temp <= 0
        chain = _new_chain()
        if self.greedy:
            C.llama_sampler_chain_add(chain, C.llama_sampler_init_greedy())
        else:
            _add_transform(chain, temp, top_k, top_p, min_p)
            C.llama_sampler_chain_add(chain, C.llama_sampler_init_dist(int(seed) & 0xFFFFFFFF))
        self._h = chain

    def sample(self, ctx: Context, idx: int) -> int:
        """Sample (and accept) a token from output row `idx` of ctx's last decode."""
        with call_clock(f"{ctx.name} sampling"):
            return int(H.llama_sampler_sample(self._h, ctx.handle, ctx.output_index(idx)))

    def _free(self, handle) -> None:
        C.llama_sampler_free(handle)


def quantize(src: str | os.PathLike, dst: str | os.PathLike, ftype: int, n_threads: int = 0,
             allow_requantize: bool = True) -> None:
    """Write `src` to `dst` as llama.cpp file type `ftype` (LLAMA_FTYPE_*) with llama.cpp's quantizer."""
    ensure_backend()
    params = C.llama_model_quantize_default_params()
    params.ftype = int(ftype)
    params.nthread = int(n_threads)
    params.allow_requantize = bool(allow_requantize)
    rc = C.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise LlamaCallError("llama_model_quantize", int(rc), f"{src} -> {dst}")


FTYPE_ALL_F32 = C.LLAMA_FTYPE_ALL_F32
FTYPE_MOSTLY_F16 = C.LLAMA_FTYPE_MOSTLY_F16


# -- devices (ggml backend API via llama_cpp._ggml.libggml) -----------------------------------
# llama-cpp-python binds no ggml device functions, but libggml exports ggml-backend.h's device API.

from dataclasses import dataclass as _dataclass

DEVICE_TYPES = {0: "CPU", 1: "GPU", 2: "IGPU", 3: "ACCEL", 4: "META"}  # enum ggml_backend_dev_type


@_dataclass(frozen=True)
class DeviceInfo:
    name: str  # ggml's device name, e.g. "CPU", "CUDA0"
    description: str  # e.g. the CPU model or "NVIDIA GeForce RTX 4090"
    type: str  # one of DEVICE_TYPES' values
    memory_total: int  # bytes
    memory_free: int  # bytes
    device_id: str | None = None  # lower-case PCI bus id where ggml knows it ("0000:c1:00.0")


class _DevCaps(ctypes.Structure):
    _fields_ = [("async_", ctypes.c_bool), ("host_buffer", ctypes.c_bool),
                ("buffer_from_host_ptr", ctypes.c_bool), ("events", ctypes.c_bool),
                ("mmap_support", ctypes.c_bool)]


class _DevProps(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("description", ctypes.c_char_p),
                ("memory_free", ctypes.c_size_t), ("memory_total", ctypes.c_size_t),
                ("type", ctypes.c_int), ("device_id", ctypes.c_char_p), ("caps", _DevCaps)]


_ggml = None
# llama_cpp._ggml opens lib/libggml.so, a copy of the lib/libggml.so.0 that libllama loads (the wheel stores
# the links as files), so it has a ggml backend registry of its own; devices registered there (RPC) stay
# invisible to llama.cpp. Use libllama's copy, already loaded, by its soname.
_LIBGGML_SONAMES = ("libggml.so.0", "libggml.0.dylib")


def _llama_libggml():
    for name in _LIBGGML_SONAMES:
        try:
            return ctypes.CDLL(name, mode=getattr(os, "RTLD_NOLOAD", 4) | os.RTLD_LAZY)
        except OSError:
            continue
    from llama_cpp._ggml import libggml

    log.debug("libggml not found by soname; using llama_cpp._ggml's")
    return libggml


def _libggml():
    """llama.cpp's libggml with argtypes/restype set once for the device functions specq calls."""
    global _ggml
    if _ggml is None:
        lib = _llama_libggml()

        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        lib.ggml_backend_dev_count.argtypes, lib.ggml_backend_dev_count.restype = [], sz
        lib.ggml_backend_dev_get.argtypes, lib.ggml_backend_dev_get.restype = [sz], vp
        lib.ggml_backend_dev_name.argtypes, lib.ggml_backend_dev_name.restype = [vp], ctypes.c_char_p
        lib.ggml_backend_dev_description.argtypes = [vp]
        lib.ggml_backend_dev_description.restype = ctypes.c_char_p
        lib.ggml_backend_dev_memory.argtypes = [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)]
        lib.ggml_backend_dev_memory.restype = None
        lib.ggml_backend_dev_type.argtypes, lib.ggml_backend_dev_type.restype = [vp], ctypes.c_int
        lib.ggml_backend_dev_get_props.argtypes = [vp, ctypes.POINTER(_DevProps)]
        lib.ggml_backend_dev_get_props.restype = None
        lib.ggml_backend_dev_by_type.argtypes, lib.ggml_backend_dev_by_type.restype = [ctypes.c_int], vp
        lib.ggml_backend_dev_backend_reg.argtypes, lib.ggml_backend_dev_backend_reg.restype = [vp], vp
        lib.ggml_backend_reg_get_proc_address.argtypes = [vp, ctypes.c_char_p]
        lib.ggml_backend_reg_get_proc_address.restype = vp
        lib.ggml_backend_buft_name.argtypes, lib.ggml_backend_buft_name.restype = [vp], ctypes.c_char_p
        lib.ggml_backend_reg_by_name.argtypes, lib.ggml_backend_reg_by_name.restype = [ctypes.c_char_p], vp
        lib.ggml_backend_register.argtypes, lib.ggml_backend_register.restype = [vp], None
        lib.ggml_backend_reg_dev_count.argtypes, lib.ggml_backend_reg_dev_count.restype = [vp], sz
        lib.ggml_backend_reg_dev_get.argtypes, lib.ggml_backend_reg_dev_get.restype = [vp, sz], vp
        _ggml = lib
    return _ggml


def cpu_extra_buffer_types() -> dict[str, int]:
    """The CPU device's extra weight buffer types by name ("AMX", "CPU_REPACK", ...) → buft pointer."""
    ensure_backend()
    lib = _libggml()
    dev = lib.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    if not dev:
        return {}
    reg = lib.ggml_backend_dev_backend_reg(dev)
    fn = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if not fn:
        return {}
    bufts = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(fn)(dev)
    out = {}
    i = 0
    while bufts and bufts[i]:
        out[(lib.ggml_backend_buft_name(bufts[i]) or b"").decode("utf-8", "replace")] = int(bufts[i])
        i += 1
    return out


def devices() -> list[DeviceInfo]:
    """The ggml backend devices this llama.cpp build can use (a CPU-only build lists one, "CPU")."""
    ensure_backend()
    lib = _libggml()
    out = []
    for i in range(int(lib.ggml_backend_dev_count())):
        dev = lib.ggml_backend_dev_get(i)
        if not dev:
            continue
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        props = _DevProps()
        lib.ggml_backend_dev_get_props(dev, ctypes.byref(props))
        kind = int(lib.ggml_backend_dev_type(dev))
        out.append(DeviceInfo(
            name=(lib.ggml_backend_dev_name(dev) or b"").decode("utf-8", "replace"),
            description=(lib.ggml_backend_dev_description(dev) or b"").decode("utf-8", "replace"),
            type=DEVICE_TYPES.get(kind, f"type{kind}"),
            memory_total=int(total.value), memory_free=int(free.value),
            device_id=props.device_id.decode("ascii", "replace") if props.device_id else None))
    return out


def device_handles(names: list[str]):
    """A NULL-terminated array of ggml device handles for llama_model_params.devices, by ggml device name."""
    ensure_backend()
    lib = _libggml()
    known = {}
    for i in range(int(lib.ggml_backend_dev_count())):
        dev = lib.ggml_backend_dev_get(i)
        if dev:
            known[(lib.ggml_backend_dev_name(dev) or b"").decode("utf-8", "replace")] = dev
    missing = [n for n in names if n not in known]
    if missing:
        raise UsageError(f"unknown device {', '.join(missing)} (this build has {', '.join(known) or 'none'}); "
                         "see `specq doctor`")
    return (ctypes.c_void_p * (len(names) + 1))(*[known[n] for n in names], None)


def ftype_by_name() -> dict[str, int]:
    """llama.cpp's file types by their usual names (Q4_K_M, Q8_0, BF16, F32, ...), read from the bindings."""
    out = {k[len("LLAMA_FTYPE_MOSTLY_"):]: int(getattr(C, k)) for k in dir(C) if k.startswith("LLAMA_FTYPE_MOSTLY_")}
    out["F32"] = int(C.LLAMA_FTYPE_ALL_F32)
    return out


def quantize_with_progress(src: str | os.PathLike, dst: str | os.PathLike, ftype: int, n_threads: int = 0,
                           on_tensor=None) -> None:
    """quantize(), calling on_tensor(i, n) as llama.cpp's quantizer logs each tensor ("[  i/  n] name ...")."""
    ensure_backend()

    @C.llama_log_callback
    def _progress_log(level: int, text: bytes, user: ctypes.c_void_p) -> None:
        if on_tensor is not None and text.startswith(b"["):
            head = text[1:text.find(b"]")].split(b"/")
            if len(head) == 2 and head[0].strip().isdigit() and head[1].strip().isdigit():
                on_tensor(int(head[0]), int(head[1]))
        _route_log(level, text, user)

    C.llama_log_set(_progress_log, ctypes.c_void_p(0))
    try:
        quantize(src, dst, ftype, n_threads)
    finally:
        C.llama_log_set(_route_log, ctypes.c_void_p(0))


# -- sampling transform (llama.cpp's sampler chain without the final draw) --------------------
# Rejection sampling needs the probabilities after top-k/top-p/min-p/temp on both models. The C
# chain does this several times faster than numpy's np.partition/argpartition top-k on a large vocabulary, and
# is by construction the same transform the baseline's dist sampler uses.

_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
assert _TOKEN_DATA.itemsize == ctypes.sizeof(C.llama_token_data)


class TransformChain(_Handle):
    """top-k → top-p → min-p → temp (as Sampler, minus dist); `apply` returns the kept ids and scaled logits."""

    def __init__(self, temp: float, top_k: int, top_p: float, min_p: float):
        if temp <= 0:
            raise SpecqError(f"the sampling transform needs a temperature > 0 ({temp})")
        chain = _new_chain()
        _add_transform(chain, temp, top_k, top_p, min_p)
        self._h = chain
        self._buf = np.zeros(0, _TOKEN_DATA)
        self._ids = np.zeros(0, np.int32)
        self._arr = C.llama_token_data_array()

    def apply(self, row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ids int32, logits float32) of the tokens the chain keeps for one logits row, logits already / temp."""
        n = row.shape[0]
        if self._buf.shape[0] != n:
            self._buf = np.zeros(n, _TOKEN_DATA)
            self._ids = np.arange(n, dtype=np.int32)
        buf = self._buf
        buf["id"] = self._ids
        buf["logit"] = row
        arr = self._arr
        arr.data = buf.ctypes.data_as(ctypes.POINTER(C.llama_token_data))
        arr.size = n
        arr.selected = -1
        arr.sorted = False
        C.llama_sampler_apply(self._h, ctypes.byref(arr))
        k = int(arr.size)
        return buf["id"][:k].copy(), buf["logit"][:k].copy()

    def _free(self, handle) -> None:
        C.llama_sampler_free(handle)

