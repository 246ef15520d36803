"""Where a checkpoint comes from: a local directory or a Hugging Face Hub repo id (safetensors only).

Never runs model code: only config, tokenizer files (tokenizer.model is a SentencePiece protobuf, data only)
and safetensors weights are read. Pickle checkpoints (`*.bin`, `*.pt`) are refused because unpickling can
execute arbitrary code.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConversionError

log = logging.getLogger("specq.convert")

# What we download from the Hub: nothing executable, no pickles.
HUB_PATTERNS = [
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
    "special_tokens_map.json", "added_tokens.json", "chat_template.json", "chat_template.jinja", "merges.txt",
    "vocab.json",
    "*.safetensors", "*.safetensors.index.json",
]
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class Source:
    """A resolved checkpoint: its local directory and where it came from."""

    path: Path
    kind: str  # "hub" or "local"
    ref: str  # repo id, or the absolute local path
    revision: str  # resolved commit for the Hub; "" for a local directory

    @property
    def name(self) -> str:
        return self.ref.rstrip("/").split("/")[-1]


def resolve(spec: str, revision: str | None = None) -> Source:
    """A local directory if `spec` is one, else a Hub repo id downloaded (or found in the cache)."""
    p = Path(spec).expanduser()
    if p.is_dir():
        if revision:
            log.warning("--revision %s ignored for the local directory %s", revision, p)
        return Source(p.resolve(), "local", str(p.resolve()), "")
    if p.exists():
        raise ConversionError(f"model path is not a directory ({spec}); pass a checkpoint folder or a Hub repo id")
    if not _REPO_ID.match(spec) or spec.startswith((".", "/", "~")):
        raise ConversionError(f"model directory not found ({spec}); check the path, or pass a Hub repo id "
                              "like Qwen/Qwen2.5-0.5B-Instruct")
    return _download(spec, revision)


def _download(repo_id: str, revision: str | None) -> Source:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    try:
        path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS))
    except GatedRepoError:
        raise ConversionError(f"the Hub repo is gated ({repo_id}); accept its licence on huggingface.co and set "
                              "HF_TOKEN")
    except RepositoryNotFoundError:
        raise ConversionError(f"no local folder and no such Hub repo, or it is private ({repo_id}); check the "
                              "path or repo id, or set HF_TOKEN")
    except RevisionNotFoundError:
        raise ConversionError(f"no such revision in {repo_id} ({revision}); check --revision")
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        if constants.HF_HUB_OFFLINE:
            raise ConversionError(f"model is not in the local Hugging Face cache and HF_HUB_OFFLINE is set "
                                  f"({repo_id}); unset HF_HUB_OFFLINE to download it, or pass a local directory")
        raise ConversionError(f"could not reach the Hugging Face Hub for {repo_id}; check the network, "
                              "or pass a local directory")
    except OSError as e:
        raise ConversionError(f"download of {repo_id} failed ({e}); check the network and free disk space")
    # snapshot paths end in .../snapshots/<commit>
    return Source(path, "hub", repo_id, path.name)


def weight_files(src: Source) -> list[Path]:
    """The safetensors files of a checkpoint, in index order; refuses pickle-only checkpoints."""
    d = src.path
    if not (d / "config.json").is_file():
        raise ConversionError(f"no config.json in {src.ref}; this is not a Hugging Face checkpoint folder")
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (ValueError, KeyError) as e:
            raise ConversionError(f"{index} is malformed ({e}); download the checkpoint again")
        files = [d / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ConversionError(f"checkpoint shard missing ({', '.join(missing)} in {src.ref}); "
                                  "download the checkpoint again")
        return files
    files = sorted(d.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(f.name for f in d.iterdir() if f.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ConversionError(
            f"only pickle weights in {src.ref} ({', '.join(pickles[:3])}); specq reads safetensors only because "
            "loading a pickle can run arbitrary code: use a repo or revision that ships *.safetensors")
    raise ConversionError(f"no *.safetensors weights in {src.ref}; specq converts safetensors checkpoints only")


def read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConversionError(f"{what} not found ({path}); the checkpoint is incomplete")
    except ValueError as e:
        raise ConversionError(f"{what} is not valid JSON ({path}: {e}); fix or re-download it")
