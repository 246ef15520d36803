"""Load what convert wrote before reporting success: a pair that llama.cpp cannot load is a failure."""

from __future__ import annotations

from pathlib import Path

from ..errors import ConversionError, ModelFileError


def verify_output(path: Path) -> None:
    """Check the file's tensors against its architecture and load its vocabulary with llama.cpp."""
    from ..native.llama import ffi as _ffi
    from ..native.llama.interrupts import deferred_sigint

    try:
        with deferred_sigint():  # llama.cpp's log callback would swallow a Ctrl-C during the load
            _ffi.Model(path, vocab_only=True).close()
    except ModelFileError as e:
        raise ConversionError(f"the converted file does not load ({path.name}: {e}); this is a bug in specq's "
                              "converter: please report it with the checkpoint's config.json")
