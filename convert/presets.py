"""Known target + draft pairs: the TOML data files in `specq/models/`, checked against one schema.

Presets are data, never executed: they are read with tomllib through importlib.resources, so they work the
same from a wheel as from the source tree.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Any

from ..errors import ManifestError, UsageError
from .arch import SUPPORTED
from .quantize import QUANT_TYPES
from .source import _REPO_ID

PACKAGE = "specq.models"
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")

# key -> (python types accepted, description used in error messages)
_NUMBER = (int, float)
TOP_KEYS: dict[str, tuple[tuple[type, ...], str]] = {
    "name": ((str,), "a string"),
    "architecture": ((str,), "a string"),
    "target": ((str,), "a Hub repo id"),
    "draft": ((str,), "a Hub repo id"),
    "target_quant": ((str,), "a quant type name"),
    "draft_quant": ((str,), "a quant type name"),
    "context_length": ((int,), "an integer"),
    "note": ((str,), "a string"),
    "download_gib": (_NUMBER, "a number"),
    "gguf_gib": (_NUMBER, "a number"),
    "vram_gib": (_NUMBER, "a number"),
    "settings": ((dict,), "a table"),
}
# Optional keys: how the pair's vocabularies were checked, and the variant for two 24 GB cards.
OPTIONAL_KEYS: dict[str, tuple[tuple[type, ...], str]] = {
    "vocab_verified": ((bool,), "true or false"),
    "vocab_check": ((str,), "a string saying by what (or why not)"),
    "two_gpus": ((dict,), "a table"),
}
TWO_GPU_KEYS: dict[str, tuple[tuple[type, ...], str]] = {
    "target_quant": ((str,), "a quant type name"),
    "context_length": ((int,), "an integer"),
    "vram_gib": (_NUMBER, "a number"),
}
SETTINGS_KEYS: dict[str, tuple[tuple[type, ...], str]] = {
    "draft_max": ((int, str), "an integer or \"auto\""),
    "draft_min": ((int,), "an integer"),
    "p_min": (_NUMBER, "a number"),
}


@dataclass(frozen=True)
class Preset:
    name: str
    architecture: str
    target: str
    draft: str
    target_quant: str
    draft_quant: str
    context_length: int
    note: str
    download_gib: float
    gguf_gib: float
    vram_gib: float
    settings: dict[str, Any] = field(default_factory=dict)
    vocab_verified: bool | None = None  # None: the preset does not say
    vocab_check: str = ""
    two_gpus: dict[str, Any] = field(default_factory=dict)

    def manifest_settings(self) -> dict[str, Any]:
        """What `convert --preset` writes into the manifest's [settings] (bench/chat read these)."""
        return {**self.settings, "ctx": self.context_length, "preset": self.name}

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _check_keys(doc: dict, schema: dict, where: str, optional: dict | None = None) -> None:
    known = {**schema, **(optional or {})}
    for key in doc:
        if key not in known:
            raise ManifestError(f"unknown key in preset ({where}: {key}); the keys are {', '.join(known)}")
    for key, (types, what) in known.items():
        if key not in doc:
            if key in schema:
                raise ManifestError(f"missing key in preset ({where}: {key}); add it as {what}")
            continue
        v = doc[key]
        # TOML booleans are Python ints; a boolean is never a valid count or size here.
        if (isinstance(v, bool) and bool not in types) or not isinstance(v, types):
            raise ManifestError(f"wrong type in preset ({where}: {key} = {v!r}); it must be {what}")


def parse_preset(doc: dict, where: str) -> Preset:
    """Validate one parsed preset file; `where` names it in error messages."""
    _check_keys(doc, TOP_KEYS, where, OPTIONAL_KEYS)
    _check_keys(doc["settings"], SETTINGS_KEYS, f"{where} [settings]")
    two = doc.get("two_gpus")
    if two is not None:
        _check_keys(two, TWO_GPU_KEYS, f"{where} [two_gpus]")
        if two["target_quant"] not in QUANT_TYPES or two["context_length"] < 256 or two["vram_gib"] <= 0:
            raise ManifestError(f"preset [two_gpus] value out of range ({where}); need a known target_quant, "
                                "context_length >= 256 and vram_gib > 0")
    if ("vocab_verified" in doc) != ("vocab_check" in doc):
        raise ManifestError(f"preset vocab_verified and vocab_check go together ({where}); give both or neither")
    if not _NAME.match(doc["name"]):
        raise ManifestError(f"preset name must be lower-case letters, digits, '.', '-' ({where}: {doc['name']!r})")
    for key in ("target", "draft"):
        if not _REPO_ID.match(doc[key]):
            raise ManifestError(f"{key} is not a Hub repo id like org/name ({where}: {doc[key]!r})")
    for key in ("target_quant", "draft_quant"):
        if doc[key] not in QUANT_TYPES:
            raise ManifestError(f"unknown {key} ({where}: {doc[key]!r}); choose one of {', '.join(QUANT_TYPES)}")
    if doc["architecture"] not in SUPPORTED:
        raise ManifestError(f"architecture the converter does not support ({where}: {doc['architecture']}); "
                            f"specq converts {', '.join(SUPPORTED)}")
    if "\n" in doc["note"]:
        raise ManifestError(f"preset note must be one line ({where})")
    s = doc["settings"]
    k = s["draft_max"]
    if isinstance(k, str) and k != "auto":
        raise ManifestError(f"preset draft_max must be an integer or \"auto\" ({where}: {k!r})")
    cap = 16 if k == "auto" else k  # auto drafts at most 16 tokens a step
    if doc["context_length"] < 256 or cap < 1 or not 0 <= s["draft_min"] <= cap or not 0.0 <= s["p_min"] <= 1.0:
        raise ManifestError(f"preset value out of range ({where}); need context_length >= 256, draft_max >= 1 or "
                            "auto, 0 <= draft_min <= draft_max, 0 <= p_min <= 1")
    for key in ("download_gib", "gguf_gib", "vram_gib"):
        if doc[key] <= 0:
            raise ManifestError(f"preset size must be positive ({where}: {key} = {doc[key]})")
    values = {k: doc[k] for k in TOP_KEYS if k != "settings"}
    for key in ("download_gib", "gguf_gib", "vram_gib"):
        values[key] = float(values[key])
    extra = {k: doc[k] for k in OPTIONAL_KEYS if k in doc}
    if "two_gpus" in extra:
        extra["two_gpus"] = {**extra["two_gpus"], "vram_gib": float(extra["two_gpus"]["vram_gib"])}
    return Preset(**values, settings={**s, "p_min": float(s["p_min"])}, **extra)


def load_presets() -> dict[str, Preset]:
    """Every packaged preset by name, sorted by name; a malformed file raises ManifestError naming it."""
    found: dict[str, Preset] = {}
    for entry in sorted(resources.files(PACKAGE).iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".toml") or not entry.is_file():
            continue
        try:
            doc = tomllib.loads(entry.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ManifestError(f"preset file is not valid TOML ({entry.name}: {e}); fix or reinstall specq")
        p = parse_preset(doc, entry.name)
        if p.name != entry.name[: -len(".toml")]:
            raise ManifestError(f"preset name differs from its file name ({entry.name}: {p.name!r}); rename one")
        found[p.name] = p
    return found


def get_preset(name: str) -> Preset:
    presets = load_presets()
    if name not in presets:
        raise UsageError(f"unknown preset ({name}); choose one of {', '.join(presets)}")
    return presets[name]
