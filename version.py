"""specq's version (one home: the package's face, the CLI, the manifest and the server read it here)."""

__version__ = "0.2.0"
