"""llama-cpp-python's sandboxed Jinja2 chat formatter, reached from here so that only native/llama/ imports
llama_cpp (native/core/template.py wraps it)."""

from __future__ import annotations

from llama_cpp.llama_chat_format import Jinja2ChatFormatter

__all__ = ["Jinja2ChatFormatter"]
