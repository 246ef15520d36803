"""specq: exact speculative decoding over llama.cpp, driven from Python.

The public API (docs/python-api.md), stable from here on: `load`, `Pair`, `Result`, `Stream`, `TokenEvent`,
`GenerationStats`, `SpecqError`, `WrongThreadError`. Everything under `specq.native` is internal.
"""

__all__ = ["load", "Pair", "Result", "Stream", "TokenEvent", "GenerationStats", "SpecqError", "WrongThreadError",
           "__version__"]


def __getattr__(name: str):
    """The public names, imported on first use (`import specq` alone loads no model library, and this file runs no
    import: pytest imports it as a plain module when it collects the repository's tests)."""
    if name == "__version__":
        from .version import __version__

        return __version__
    if name in __all__:
        from .native import api

        return getattr(api, name)
    raise AttributeError(f"module 'specq' has no attribute {name!r}")
