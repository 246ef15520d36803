"""A thinking model's answer split into its reasoning and the answer proper, as llama-server does
(`reasoning_content`): the markers told from the chat template, and whether the rendered prompt left the
model inside its thinking (Qwen3.5's and DeepSeek-R1's templates open `<think>` in the generation prompt)."""

from __future__ import annotations

from dataclasses import dataclass

# (start, end) markers by the text a template holds; the first whose both markers appear wins.
THINK_MARKERS = (("<think>", "</think>"), ("[THINK]", "[/THINK]"))


@dataclass(frozen=True)
class ThinkFormat:
    start: str = "<think>"
    end: str = "</think>"  # the end of thinking: a grammar on the answer applies after it


def think_format(template: str) -> ThinkFormat | None:
    """The template's thinking markers, or None for a model that does not think."""
    for start, end in THINK_MARKERS:
        if start in template and end in template:
            return ThinkFormat(start, end)
    return None


def opens_thinking(prompt: str, fmt: ThinkFormat) -> bool:
    """The rendered prompt ends inside an unclosed thinking part: the model's output starts in its reasoning."""
    return prompt.rfind(fmt.start) > prompt.rfind(fmt.end)


class ReasoningStream:
    """Output text in, (reasoning, answer) pieces out. Thinking begins where the prompt left it open or where
    the output starts with the start marker; it ends at the end marker. Marker prefixes and the whitespace
    around the markers are held back, so neither part carries a marker or the blank lines beside it."""

    def __init__(self, fmt: ThinkFormat, in_thinking: bool):
        self.fmt = fmt
        self.state = "think" if in_thinking else "start"  # start → think → answer, or start → answer
        self.buf = ""
        self.reasoning_sent = self.answer_sent = False

    @property
    def thinking(self) -> bool:
        """Still inside the reasoning (a grammar on the answer waits for `fmt.end`)."""
        return self.state != "answer"

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        self.buf += piece
        reasoning = answer = ""
        if self.state == "start":
            head = self.buf.lstrip()
            if head.startswith(self.fmt.start):
                self.state, self.buf = "think", head[len(self.fmt.start):]
            elif not final and self.fmt.start.startswith(head):
                return "", ""  # may still become the start marker
            else:
                self.state = "answer"
        if self.state == "think":
            reasoning = self._think(final)
        if self.state == "answer":
            if not self.answer_sent:
                self.buf = self.buf.lstrip()
            answer, self.buf = self.buf, ""
            self.answer_sent = self.answer_sent or bool(answer)
        return reasoning, answer

    def _think(self, final: bool) -> str:
        if not self.reasoning_sent:
            self.buf = self.buf.lstrip()
        i = self.buf.find(self.fmt.end)
        if i >= 0:
            out, self.buf, self.state = self.buf[:i].rstrip(), self.buf[i + len(self.fmt.end):], "answer"
        else:
            cut = len(self.buf) - (0 if final else partial_suffix(self.buf, self.fmt.end))
            out = self.buf[:cut].rstrip()  # trailing whitespace waits: it may precede the end marker
            self.buf = "" if final else self.buf[len(out):]
        self.reasoning_sent = self.reasoning_sent or bool(out)
        return out


def partial_suffix(text: str, marker: str) -> int:
    """The longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def split_reasoning(text: str, fmt: ThinkFormat, in_thinking: bool) -> tuple[str, str]:
    """A whole output → (reasoning, answer)."""
    return ReasoningStream(fmt, in_thinking).feed(text, final=True)
