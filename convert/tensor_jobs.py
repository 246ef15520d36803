"""One checkpoint -> the tensor jobs (names, types, shapes and row transforms) the GGUF writer carries out."""

from __future__ import annotations

import re
from dataclasses import dataclass

import gguf
import numpy as np

from ..errors import ConversionError
from . import align, gemma3, qwen35
from ..native.llama.gguf_check import architecture_tensors
from .arch import ArchSpec, NameMap, read_config, rope_freqs
from .checkpoint import DTYPES, MappedFiles, TensorRef, read_checkpoint
from .source import Source, weight_files
from .vocab import Vocab, load_vocab
from .writer import OUTTYPES, TensorJob, source_outtype, to_f32

EMBED = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.TOKEN_EMBD] + ".weight"
OUTPUT = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.OUTPUT] + ".weight"
OUTPUT_BIAS = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.OUTPUT] + ".bias"
ROPE_FREQS = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
_Q = re.compile(r"^blk\.\d+\.attn_q\.(weight|bias)$")
_K = re.compile(r"^blk\.\d+\.attn_k\.(weight|bias)$")


@dataclass(frozen=True)
class Checkpoint:
    """A resolved, inspected Hugging Face checkpoint."""

    source: Source
    spec: ArchSpec
    tensors: dict[str, TensorRef]  # GGUF name -> source tensor
    vocab: Vocab

    @property
    def n_rows(self) -> int:
        return self.tensors[EMBED].shape[0]

    @property
    def dtype(self) -> str:
        return self.tensors[EMBED].dtype

    @property
    def default_outtype(self) -> str:
        return source_outtype(self.dtype)


def inspect(src: Source, mtp: bool = True) -> Checkpoint:
    """Read config, tensor headers and tokenizer; map every tensor name (nothing is loaded).

    mtp: keep a qwen35 checkpoint's multi-token-prediction blocks."""
    spec = read_config(src.path, src.ref)
    tensors: dict[str, TensorRef] = {}
    if spec.qwen35 is not None:
        spec, tensors = qwen35.map_tensors(spec, read_checkpoint(weight_files(src)), src.ref, keep_mtp=mtp)
    else:
        names = NameMap(spec)
        for hf_name, ref in read_checkpoint(weight_files(src)).items():
            g = names.gguf_name(hf_name)
            if g is not None:
                tensors[g] = ref
    if EMBED not in tensors:
        raise ConversionError(f"checkpoint has no token embedding (model.embed_tokens.weight in {src.ref}); "
                              "it is incomplete")
    if OUTPUT not in tensors and not spec.tied:
        raise ConversionError(f"checkpoint has no lm_head.weight and does not tie embeddings ({src.ref}); "
                              "it is incomplete")
    missing = [f"blk.{i}" for i in range(spec.n_layer) if f"blk.{i}.attn_norm.weight" not in tensors]
    if missing:
        raise ConversionError(f"checkpoint lacks layers {', '.join(missing[:4])} ({src.ref}); a shard is missing")
    if spec.qwen35 is None:
        check_shapes(spec, tensors, src.ref)
    rows = tensors[EMBED].shape[0]
    return Checkpoint(src, spec, tensors, load_vocab(src.path, rows, src.ref))


def check_shapes(spec: ArchSpec, tensors: dict[str, TensorRef], where: str) -> None:
    """Every tensor llama.cpp will create is there, in the shape config.json implies (before a byte is written)."""
    dims = {"n_embd": spec.n_embd, "n_head": spec.n_head, "n_layer": spec.n_layer, "n_ff": spec.n_ff,
            "head_k": spec.head_dim, "head_v": spec.head_dim, "k_gqa": spec.head_dim * spec.n_head_kv,
            "v_gqa": spec.head_dim * spec.n_head_kv}
    n_vocab = tensors[EMBED].shape[0]
    for x in architecture_tensors(spec.arch_name, dims, n_vocab):
        ref = tensors.get(x.name)
        if ref is None:
            if x.required:
                raise ConversionError(f"checkpoint lacks the tensor for {x.name} ({where}); a {spec.hf_arch} with "
                                      "this config.json needs it: the checkpoint is incomplete, fetch it again")
            continue
        want = tuple(reversed(x.shape))  # ggml lists the contiguous dimension first, safetensors last
        if ref.shape != want:
            raise ConversionError(f"checkpoint tensor {ref.name} has shape {list(ref.shape)}, config.json implies "
                                  f"{list(want)} ({where}); the checkpoint does not match its config: fetch it again")


def permute_rows(chunk: np.ndarray, head_dim: int) -> np.ndarray:
    """Reorder the rows of whole heads: [x0..x(d/2-1), y0..] -> [x0, y0, x1, y1, ...]."""
    n = chunk.shape[0] // head_dim
    tail = chunk.shape[1:]
    return chunk.reshape((n, 2, head_dim // 2) + tail).swapaxes(1, 2).reshape(chunk.shape)


def _order(name: str) -> tuple:
    m = re.match(r"^blk\.(\d+)\.", name)
    if name == EMBED:
        return (-1, name)
    return (int(m.group(1)), name) if m else (1 << 30, name)


def _copy_row_tracker(n_real: int, src_dtype: str):
    """Follows the output rows chunk by chunk and keeps the real row with the smallest norm."""
    state = {"row": 0, "best": None, "norm": np.inf}

    def see(chunk: np.ndarray) -> np.ndarray:
        r0 = state["row"]
        real = chunk[:max(0, n_real - r0)]
        if len(real):
            norms = np.linalg.norm(to_f32(real, src_dtype).reshape(len(real), -1), axis=1)
            i = int(norms.argmin())
            if norms[i] < state["norm"]:
                state["norm"], state["best"] = float(norms[i]), real[i].copy()
        state["row"] = r0 + len(chunk)
        return chunk

    return see, state


def build_jobs(ck: Checkpoint, outtype: str, rows_out: int | None = None, n_real: int | None = None) -> list[TensorJob]:
    """Output tensors for a checkpoint; rows_out reshapes token_embd/output (draft alignment)."""
    spec = ck.spec
    out_t = OUTTYPES[outtype][0]
    f32 = gguf.GGMLQuantizationType.F32
    plan = align.plan_rows(spec, ck.n_rows, rows_out if rows_out is not None else ck.n_rows)
    n_real = ck.vocab.n_real if n_real is None else n_real
    jobs: list[TensorJob] = []
    for name in sorted(ck.tensors, key=_order):
        ref = ck.tensors[name]
        job = TensorJob(name, f32 if len(ref.shape) <= 1 else out_t, ref.shape, ref)
        if spec.qwen35 is not None:
            qwen35.adjust_job(job, spec.qwen35)
        if spec.gemma is not None and gemma3.is_norm(name):
            job = TensorJob(name, f32, ref.shape, data=gemma3.norm_plus_one(_read_vector(ref)))
        if spec.permute_qk and (_Q.match(name) or _K.match(name)):
            job.row_block = spec.head_dim
            job.transform = lambda c, d=spec.head_dim: permute_rows(c, d)
        if name == EMBED and plan.pad_mode != "none":
            job.shape = (plan.n_rows_out,) + ref.shape[1:]
            if plan.padding:
                job.finish = lambda r=ref: align.pad_rows_zero(plan.n_rows_out - plan.n_rows_in, r.shape[1:],
                                                               DTYPES[r.dtype])
        if name == OUTPUT and plan.pad_mode != "none":
            _reshape_output(job, plan, n_real)
        jobs.append(job)
    if plan.padding and OUTPUT not in ck.tensors:
        # A tied draft gets its own output matrix: its padding rows must differ from the zero embeddings.
        ref = ck.tensors[EMBED]
        job = TensorJob(OUTPUT, out_t, ref.shape, ref)
        _reshape_output(job, plan, n_real)
        jobs.append(job)
    if plan.pad_mode == "bias":
        jobs.append(TensorJob(OUTPUT_BIAS, f32, (plan.n_rows_out,), data=align.output_bias(n_real, plan.n_rows_out)))
    freqs = rope_freqs(spec)
    if freqs is not None:
        jobs.append(TensorJob(ROPE_FREQS, f32, freqs.shape, data=freqs))
    return jobs


def _read_vector(ref: TensorRef) -> np.ndarray:
    """A small 1-D tensor as float32 (norm weights; read while planning, a few KB each)."""
    with MappedFiles() as maps:
        return to_f32(next(maps.rows(ref)), ref.dtype)


def _reshape_output(job: TensorJob, plan: align.RowPlan, n_real: int) -> None:
    ref = job.ref
    job.shape = (plan.n_rows_out,) + ref.shape[1:]
    if not plan.padding:
        return
    n_extra = plan.n_rows_out - plan.n_rows_in
    if plan.pad_mode == "copy":
        see, state = _copy_row_tracker(n_real, ref.dtype)
        job.transform = see
        job.finish = lambda: np.broadcast_to(state["best"], (n_extra,) + ref.shape[1:]).copy()
    else:
        job.finish = lambda: align.pad_rows_zero(n_extra, ref.shape[1:], DTYPES[ref.dtype])


def estimate_bytes(jobs: list[TensorJob]) -> int:
    return sum(j.nbytes for j in jobs) + (64 << 10)


def n_weights(jobs: list[TensorJob]) -> int:
    return sum(int(np.prod(j.shape, dtype=np.int64)) for j in jobs)
