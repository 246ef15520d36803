"""`convert_pair`: Hugging Face target (+ draft) -> aligned, quantized GGUF files and the pair manifest."""

from __future__ import annotations

import contextlib
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import gguf

from ..errors import ConversionError, UsageError
from . import align, qwen35
from .. import manifest
from .arch import write_hparams
from .tensor_jobs import Checkpoint, build_jobs, estimate_bytes, inspect, n_weights
from .quantize import BITS_PER_WEIGHT, parse_quant, quantize_file
from .source import resolve
from .verify import verify_output
from .vocab import Vocab, write_vocab
from .writer import OUTTYPES, ProgressFn, TensorJob, write_gguf

log = logging.getLogger("specq.convert")


@dataclass(frozen=True)
class ConvertResult:
    out_dir: Path
    manifest_path: Path
    target_path: Path
    draft_path: Path | None
    intermediates: tuple[Path, ...]
    mtp_layers: int = 0  # qwen35: MTP blocks kept in the target
    mtp_bytes: int = 0  # their size in the target file


@dataclass
class _Output:
    """One model's output files and tensor plan."""

    role: str
    ck: Checkpoint
    vocab: Vocab
    jobs: list[TensorJob]
    outtype: str
    quant: str | None
    intermediate: Path
    final: Path

    @property
    def quant_label(self) -> str:
        return self.quant or self.outtype.upper()


def _parse_outtype(value: str | None) -> str | None:
    if value is None:
        return None
    v = value.strip().lower()
    if v not in OUTTYPES:
        raise UsageError(f"unknown --outtype ({value}); choose f16, bf16 or f32")
    return v


def _plan_output(role: str, ck: Checkpoint, out_dir: Path, outtype: str | None, quant: str | None,
                 vocab: Vocab | None = None, rows_out: int | None = None, taken: set[str] = frozenset()) -> _Output:
    ot = outtype or ck.default_outtype
    jobs = build_jobs(ck, ot, rows_out=rows_out, n_real=(vocab or ck.vocab).n_real)
    name = ck.source.name
    if role == "draft" and name in taken:
        name = f"{name}-draft"
    inter = out_dir / f"{name}-{ot.upper()}.gguf"
    final = out_dir / f"{name}-{quant}.gguf" if quant else inter
    return _Output(role, ck, vocab or ck.vocab, jobs, ot, quant, inter, final)


def _check_disk(out_dir: Path, outs: list[_Output], keep: bool) -> None:
    """Refuse early when the files (at their largest moment) would not fit."""
    peak, kept = 0, 0
    for o in outs:
        inter = estimate_bytes(o.jobs)
        q = int(n_weights(o.jobs) * BITS_PER_WEIGHT[o.quant] / 8) if o.quant else 0
        peak = max(peak, kept + inter + q)
        kept += (inter + q) if keep else (q or inter)
    free = shutil.disk_usage(out_dir).free
    if peak > free:
        raise ConversionError(f"not enough free disk space in {out_dir} (need about {peak / 1e9:.2f} GB, "
                              f"{free / 1e9:.2f} GB free); free some space or choose another --out")


def _write_model(o: _Output, threads: int, progress: ProgressFn | None, created: list[Path]) -> None:
    ck = o.ck
    ftype = OUTTYPES[o.outtype][1]

    def metadata(w: gguf.GGUFWriter) -> None:
        w.add_name(ck.source.name)
        write_hparams(w, ck.spec)
        w.add_file_type(ftype)
        write_vocab(w, o.vocab)

    created.append(o.intermediate)
    write_gguf(o.intermediate, ck.spec.arch_name, metadata, o.jobs, task=f"write {o.role}", progress=progress)
    if o.quant:
        created.append(o.final)
        quantize_file(o.intermediate, o.final, o.quant, threads=threads, progress=progress,
                      task=f"quantize {o.role} {o.quant}")


def _mtp_bytes(o: _Output) -> int:
    """Bytes the MTP blocks take in the written file (read from its tensor table)."""
    p = o.ck.spec.qwen35
    if p is None or not p.n_mtp:
        return 0
    r = gguf.GGUFReader(o.final)
    names = set(qwen35.mtp_names(p, [t.name for t in r.tensors]))
    return sum(int(t.n_bytes) for t in r.tensors if t.name in names)


def _manifest_entry(o: _Output) -> dict:
    src = o.ck.source
    mtp = {}
    if o.ck.spec.qwen35 is not None:
        mtp = {"mtp_layers": o.ck.spec.qwen35.n_mtp, "mtp_bytes": _mtp_bytes(o)}
    return {**mtp, "file": o.final.name, "sha256": manifest.sha256_file(o.final), "source": src.ref,
            "revision": src.revision, "source_kind": src.kind, "architecture": o.ck.spec.arch_name,
            "hf_architecture": o.ck.spec.hf_arch, "quant": o.quant_label, "outtype": o.outtype,
            "n_vocab": o.vocab.n_rows, "n_real_vocab": o.vocab.n_real}


def convert_pair(target: str, out_dir: str | Path, *, draft: str | None = None, outtype: str | None = None,
                 quant: str | None = "Q4_K_M", draft_quant: str | None = "Q8_0", revision: str | None = None,
                 draft_revision: str | None = None, force: bool = False, keep_intermediate: bool = False,
                 threads: int = 0, progress: ProgressFn | None = None,
                 settings: dict | None = None, mtp: bool = True) -> ConvertResult:
    """Convert TARGET (and DRAFT) to GGUF in out_dir, quantize, align the draft and write the manifest.

    target/draft: a local checkpoint folder or a Hub repo id. quant/draft_quant: a type name or
    None/"none" for the unquantized file. outtype: f16/bf16/f32, default the source dtype.
    settings: suggested settings (a preset's) written into the manifest over the computed ones.
    mtp: keep a qwen35 target's multi-token-prediction blocks (a draft never carries them: specq drafts
    with the draft model, and llama.cpp skips MTP tensors unless asked to load them).
    Nothing is left behind on failure: files this call created are removed.
    """
    ot = _parse_outtype(outtype)
    q_t = parse_quant(quant, "--quant")
    q_d = parse_quant(draft_quant, "--draft-quant")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out is not a directory ({out}); pass a folder")

    # Everything that can be refused is checked before the first byte is written.
    t_ck = inspect(resolve(target, revision), mtp=mtp)
    outs = [_plan_output("target", t_ck, out, ot, q_t)]
    if draft is not None:
        d_ck = inspect(resolve(draft, draft_revision), mtp=False)
        align.check_same_vocabulary(t_ck.vocab, d_ck.vocab)
        if d_ck.n_rows != t_ck.n_rows:
            log.info("draft rows %d -> target rows %d", d_ck.n_rows, t_ck.n_rows)
        outs.append(_plan_output("draft", d_ck, out, ot, q_d, vocab=t_ck.vocab, rows_out=t_ck.n_rows,
                                 taken={t_ck.source.name}))

    out.mkdir(parents=True, exist_ok=True)
    finals = [o.final for o in outs] + [out / manifest.MANIFEST_NAME]
    if keep_intermediate:
        finals += [o.intermediate for o in outs if o.quant]
    existing = [p for p in finals if p.exists()]
    if existing and not force:
        raise ConversionError(f"output already exists ({existing[0]}); pass --force to overwrite it")
    _check_disk(out, outs, keep_intermediate)

    created: list[Path] = []
    try:
        for o in outs:
            _write_model(o, threads, progress, created)
            verify_output(o.final)
            if o.quant and not keep_intermediate:
                o.intermediate.unlink()
                created.remove(o.intermediate)
        t_entry = _manifest_entry(outs[0])
        d_entry = _manifest_entry(outs[1]) if len(outs) > 1 else None
        suggested: dict = {}
        if d_entry is not None:
            c = outs[1].final.stat().st_size / outs[0].final.stat().st_size
            # No acceptance is known before a run: the draft length is chosen as it runs (`specq tune` measures).
            suggested = {"draft_max": "auto", "draft_min": 0, "p_min": 0.0, "cost_ratio": round(c, 4)}
        mpath = manifest.write_manifest(out, t_entry, d_entry, {**suggested, **(settings or {})})
    except BaseException:
        for p in created:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        raise
    inter = tuple(o.intermediate for o in outs if o.quant and keep_intermediate)
    return ConvertResult(out, mpath, outs[0].final, outs[1].final if len(outs) > 1 else None, inter,
                         t_entry.get("mtp_layers", 0), t_entry.get("mtp_bytes", 0))
