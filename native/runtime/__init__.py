"""The runtime, above the drafters: the engine (models and contexts), sessions, generations, batches of
sequences and the one speculative step. It composes the drafters (drafters/registry.py) over the primitives of
native/core/, which never import it (tests/test_layout.py)."""
