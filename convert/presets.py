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
    "vocab_verified": ((str,), "what verified the two vocabularies compatible, or \"no\""),
    "settings": ((dict,), "a table"),
}
# Optional: the pair on two 24 GiB cards (a longer context; VRAM summed over both cards).
OPTIONAL_KEYS: dict[str, tuple[tuple[type, ...], str]] = {
    "context_length_two_cards": ((int,), "an integer"),
    "vram_gib_two_cards": (_NUMBER, "a number"),
}
SETTINGS_KEYS: dict[str, tuple[tuple[type, ...], str]] = {
    "draft_max": ((int, str), "an integer or \"auto\""),
    "draft_min": ((int,), "an integer"),
    "p_min": (_NUMBER, "a number"),
}
OPTIONAL_SETTINGS: dict[str, tuple[tuple[type, ...], str]] = {
    "drafter": ((str,), "model, ngram, mtp, a comma list of them, or \"auto\""),
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
    vocab_verified: str
    settings: dict[str, Any] = field(default_factory=dict)
    context_length_two_cards: int | None = None
    vram_gib_two_cards: float | None = None

    def manifest_settings(self) -> dict[str, Any]:
        """What `convert --preset` writes into the manifest's [settings] (bench/chat read these)."""
        return {**self.settings, "ctx": self.context_length, "preset": self.name}

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _check_keys(doc: dict, schema: dict, where: str, optional: dict | None = None) -> None:
    allowed = {**schema, **(optional or {})}
    for key in doc:
        if key not in allowed:
            raise ManifestError(f"unknown key in preset ({where}: {key}); the keys are {', '.join(allowed)}")
    for key, (types, what) in allowed.items():
        if key not in doc:
            if key in schema:
                raise ManifestError(f"missing key in preset ({where}: {key}); add it as {what}")
            continue
        v = doc[key]
        # TOML booleans are Python ints; a boolean is never a valid count or size here.
        if isinstance(v, bool) or not isinstance(v, types):
            raise ManifestError(f"wrong type in preset ({where}: {key} = {v!r}); it must be {what}")


def _check_drafter(settings: dict, where: str) -> None:
    """[settings] drafter (optional): model, ngram, mtp, a comma list of them, or auto."""
    if "drafter" not in settings:
        return
    from ..native.drafters.registry import parse_drafter

    v = settings["drafter"]
    try:
        ok = isinstance(v, str) and bool(parse_drafter(v))
    except UsageError:
        ok = False
    if not ok:
        raise ManifestError(f"preset drafter must be model, ngram, mtp, a comma list of them, or auto "
                            f"({where}: drafter = {v!r})")


def parse_preset(doc: dict, where: str) -> Preset:
    """Validate one parsed preset file; `where` names it in error messages."""
    _check_keys(doc, TOP_KEYS, where, OPTIONAL_KEYS)
    _check_keys(doc["settings"], SETTINGS_KEYS, f"{where} [settings]", OPTIONAL_SETTINGS)
    _check_drafter(doc["settings"], where)
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
    for key in ("note", "vocab_verified"):
        if "\n" in doc[key] or not doc[key].strip():
            raise ManifestError(f"preset {key} must be one line, not empty ({where})")
    two = [k for k in OPTIONAL_KEYS if k in doc]
    if two and len(two) != len(OPTIONAL_KEYS):
        raise ManifestError(f"preset gives {two[0]} without {', '.join(k for k in OPTIONAL_KEYS if k not in doc)} "
                            f"({where}); give both or neither")
    if two and (doc["context_length_two_cards"] < doc["context_length"] or doc["vram_gib_two_cards"] <= 0):
        raise ManifestError(f"preset two-card values out of range ({where}); need context_length_two_cards >= "
                            "context_length and vram_gib_two_cards > 0")
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
    values = {k: doc[k] for k in (*TOP_KEYS, *OPTIONAL_KEYS) if k != "settings" and k in doc}
    for key in ("download_gib", "gguf_gib", "vram_gib", "vram_gib_two_cards"):
        if key in values:
            values[key] = float(values[key])
    return Preset(**values, settings={**s, "p_min": float(s["p_min"])})


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
