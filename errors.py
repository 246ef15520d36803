"""specq's exceptions, in one place.

Library code raises these; only `specq.cli` turns them into one-line messages and exit codes.
Messages say what was wrong, with the value, and what to do.
"""


class SpecqError(Exception):
    """Base class: a failure the user can act on (exit code 1)."""

    exit_code = 1


class UsageError(SpecqError):
    """A bad flag value or combination (exit code 2)."""

    exit_code = 2


class ModelFileError(SpecqError):
    """A model file is missing, not a GGUF, truncated or unloadable."""


class IncompatibleDraftError(SpecqError):
    """The draft's vocabulary does not match the target's."""


class ContextFullError(SpecqError):
    """The prompt (or the conversation) does not fit in the context."""


class LlamaCallError(SpecqError):
    """A llama.cpp C call returned an error code."""

    def __init__(self, call: str, code: int, detail: str = ""):
        self.call = call
        self.code = code
        msg = f"llama.cpp call {call} failed (return code {code})"
        if detail:
            msg += f"; {detail}"
        super().__init__(msg)


class ConversionError(SpecqError):
    """A Hugging Face checkpoint could not be converted."""


class ManifestError(SpecqError):
    """A pair manifest is missing, malformed, or does not match its files."""


class RpcError(SpecqError):
    """An RPC server is unreachable, incompatible or lost, or the RPC backend is missing."""


class PlanError(SpecqError):
    """The models do not fit in the given memory budget."""


def check_text(text: str, what: str) -> str:
    """Text bound for the tokenizer, refused where it cannot be encoded as UTF-8: a lone surrogate, which valid
    JSON ("\\udcff") and undecodable bytes carried in as surrogate escapes (argv, stdin) both produce."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(f"{what} is not valid UTF-8 text (a lone surrogate {ascii(text[e.start])[1:-1]} at "
                         f"character {e.start}); send UTF-8 text without unpaired \\ud800-\\udfff escapes")
    return text
