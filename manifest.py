"""The pair manifest `DIR/specq-pair.toml` (see INTERFACES.md): written by convert, read by bench/chat/tune.

Readers ignore keys they do not know; checksums are verified when a pair is loaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .version import __version__
from .atomic import atomic_output, write_text
from .errors import ManifestError
from .machine import cache_dir

log = logging.getLogger("specq.convert")

MANIFEST_NAME = "specq-pair.toml"
FORMAT_VERSION = 1
MODEL_KEYS = ("file", "sha256", "source", "revision", "architecture", "quant", "n_vocab")
# The first specq whose converter computes value transforms (qwen35's norm + 1 and A = -exp(A_log)) in float32;
# older ones rounded them to a BF16/F16 checkpoint's dtype. The manifest's top-level converter_version says which.
FLOAT32_TRANSFORMS_VERSION = "0.2.0"
ROUNDED_ARCHS = ("qwen35", "qwen35moe")


def sha256_file(path: Path, block: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def verified_sha256(path: Path) -> str:
    """sha256 of a file, remembered per (path, size, mtime) so a multi-GB pair is hashed once, not per start."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    store = cache_dir() / "verified-sha256.json"
    try:
        known = json.loads(store.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        known = {}
    if isinstance(known, dict) and isinstance(known.get(key), str):
        return known[key]
    digest = sha256_file(path)
    known = known if isinstance(known, dict) else {}
    known[key] = digest
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        write_text(store, json.dumps(known))
    except OSError:
        pass  # a read-only cache only costs a re-hash next time
    return digest


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"TOML manifest cannot hold {v}")
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # a JSON string is a valid TOML basic string
    raise TypeError(f"manifest values are flat scalars, got {type(v).__name__}")


def dumps(doc: dict[str, Any]) -> str:
    """A small TOML writer for one level of tables of scalars (all the manifest needs)."""
    lines = [f"{k} = {_value(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    for k, table in doc.items():
        if isinstance(table, dict):
            lines += ["", f"[{k}]"] + [f"{tk} = {_value(tv)}" for tk, tv in table.items() if tv is not None]
    return "\n".join(lines) + "\n"


def write_manifest(out_dir: Path, target: dict[str, Any], draft: dict[str, Any] | None,
                   settings: dict[str, Any]) -> Path:
    doc: dict[str, Any] = {"format_version": FORMAT_VERSION, "converter_version": __version__, "target": target}
    if draft is not None:
        doc["draft"] = draft
    doc["settings"] = settings
    path = out_dir / MANIFEST_NAME
    with atomic_output(path) as tmp:
        tmp.write_text(dumps(doc), encoding="utf-8")
    return path


@dataclass(frozen=True)
class Pair:
    """A loaded pair manifest: absolute model paths and the suggested settings."""

    dir: Path
    target_path: Path
    draft_path: Path | None
    settings: dict[str, Any] = field(default_factory=dict)
    manifest: dict[str, Any] = field(default_factory=dict)


def _model_path(d: Path, doc: dict, role: str, verify: bool) -> Path:
    entry = doc.get(role)
    if not isinstance(entry, dict) or not isinstance(entry.get("file"), str):
        raise ManifestError(f"manifest has no [{role}] file ({d / MANIFEST_NAME}); re-run `specq convert`")
    name = entry["file"]
    if Path(name).name != name:
        raise ManifestError(f"manifest file name must be a plain name in the pair folder ({name}); fix "
                            f"{d / MANIFEST_NAME}")
    path = d / name
    if not path.is_file():
        raise ManifestError(f"{role} model listed in the manifest is missing ({path}); re-run `specq convert`")
    if verify:
        want = entry.get("sha256")
        if not isinstance(want, str):
            raise ManifestError(f"manifest has no sha256 for the {role} ({d / MANIFEST_NAME}); re-run `specq convert`")
        got = verified_sha256(path)
        if got != want:
            raise ManifestError(f"{role} model does not match its checksum ({path}: sha256 {got[:12]}…, manifest "
                                f"{want[:12]}…); the file was changed or is corrupt: re-run `specq convert --force`")
    return path


def version_tuple(version: Any) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a version string such as 0.2.0 or 0.2.0.dev1; None when it is not one."""
    m = re.match(r"^(\d+)\.(\d+)(?:\.(\d+))?", version) if isinstance(version, str) else None
    return (int(m[1]), int(m[2]), int(m[3] or 0)) if m else None


def reconvert_hint(doc: dict[str, Any], where: Path) -> str | None:
    """One line for a qwen35 pair that an older specq (or one that recorded no converter_version) wrote: its
    norms and A may be rounded to the checkpoint's dtype, and converting again is closer to the checkpoint."""
    entries = [doc.get(role) for role in ("target", "draft")]
    archs = [e.get("architecture") for e in entries if isinstance(e, dict) and e.get("architecture") in ROUNDED_ARCHS]
    if not archs:
        return None
    version = doc.get("converter_version")
    got = version_tuple(version)
    if got is not None and got >= version_tuple(FLOAT32_TRANSFORMS_VERSION):
        return None
    who = f"specq {version}" if got is not None else "a specq that recorded no converter_version"
    return (f"this {archs[0]} pair was converted by {who} ({where}), which rounded the norms and A of a BF16/F16 "
            f"checkpoint to that dtype; converting it again with specq >= {FLOAT32_TRANSFORMS_VERSION} "
            "(`specq convert ... --force`) improves fidelity")


def load_pair(pair_dir: str | os.PathLike, verify: bool = True, hint: bool = True) -> Pair:
    """Read DIR/specq-pair.toml and (by default) verify both files' sha256.

    hint: log the one-line reconversion hint (reconvert_hint) for a pair an older converter wrote."""
    d = Path(pair_dir)
    path = d / MANIFEST_NAME
    if not d.is_dir():
        raise ManifestError(f"pair folder not found ({d}); pass the --out folder of `specq convert`")
    if not path.is_file():
        raise ManifestError(f"no {MANIFEST_NAME} in {d}; convert a pair with `specq convert --out {d}`")
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"manifest is not valid TOML ({path}: {e}); re-run `specq convert --force`")
    version = doc.get("format_version")
    if version != FORMAT_VERSION:
        raise ManifestError(f"unsupported manifest format_version ({version}) in {path}; this specq reads "
                            f"version {FORMAT_VERSION}")
    target = _model_path(d, doc, "target", verify)
    draft = _model_path(d, doc, "draft", verify) if "draft" in doc else None
    settings = doc.get("settings") if isinstance(doc.get("settings"), dict) else {}
    if hint and (message := reconvert_hint(doc, path)):
        log.warning(message)
    return Pair(d, target, draft, dict(settings), doc)
