"""The chat template, shared by `specq serve`, `specq chat` and the Python API: --template or the model's own, and the
conversation rendered through llama-cpp-python's sandboxed Jinja2 formatter (which gives templates
`raise_exception`, `strftime_now`, `tools` and any extra variables, as Hugging Face's renderer does)."""

from __future__ import annotations

from pathlib import Path

from ...errors import SpecqError, UsageError


def load_template(arg: str | None, model_template: str | None, model_path: str = "") -> str:
    """--template (a file, or Jinja text) wins over the model's own; neither is an error."""
    if arg:
        p = Path(arg)
        if p.is_file():
            return p.read_text(encoding="utf-8")
        if "{{" in arg or "{%" in arg:
            return arg
        raise UsageError(f"--template is neither a file nor a Jinja template ({arg}); "
                         "pass a template file or the template text")
    if not model_template:
        raise SpecqError(f"the model has no chat template ({model_path}); "
                         "pass --template FILE with a Jinja chat template for it")
    return model_template


class TemplateFormatter:
    """The conversation → prompt text, through llama-cpp-python's sandboxed Jinja2 chat formatter."""

    def __init__(self, template: str, bos_token: str, eos_token: str):
        import jinja2

        from ..llama.chat_format import Jinja2ChatFormatter

        try:
            self._fmt = Jinja2ChatFormatter(template, eos_token=eos_token, bos_token=bos_token,
                                            add_generation_prompt=True)
        except jinja2.TemplateError as e:
            raise SpecqError(f"the chat template does not parse ({e}); pass a working one with --template")

    @classmethod
    def for_model(cls, template: str, model) -> "TemplateFormatter":
        """The formatter with the model's BOS and EOS token texts (what templates call bos_token, eos_token)."""
        return cls(template, model_token_text(model, model.bos), model_token_text(model, model.eos))

    def render(self, messages: list[dict], tools: list[dict] | None = None, extra: dict | None = None) -> str:
        """The prompt text; `tools` and the request's chat_template_kwargs (`extra`) go to the template as
        variables, as Hugging Face's apply_chat_template passes them."""
        import jinja2

        try:
            return self._fmt(messages=messages, tools=tools or None, **(extra or {})).prompt
        except (jinja2.TemplateError, ValueError, TypeError) as e:
            raise SpecqError(f"the chat template refused the conversation ({e}); "
                             "check the roles (some templates need user/assistant turns to alternate)")


def model_token_text(model, token: int) -> str:
    """A special token's text ("" where the model has none: id < 0)."""
    return model.token_text(token).decode("utf-8", "replace") if token >= 0 else ""
