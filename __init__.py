"""specq: exact draft-model speculative decoding over llama.cpp."""

__version__ = "0.2.0"
