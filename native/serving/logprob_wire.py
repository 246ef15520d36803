"""`logprobs` on the wire: the request fields (chat: `logprobs` + `top_logprobs`; completions: `logprobs: N`) and
the response objects, OpenAI's shapes. The values are the engine's (core/logprobs.py: the target's raw
log-softmax); an end-of-generation token is not part of the text and gets no entry, as in OpenAI's API."""

from __future__ import annotations

import json
from typing import Callable

from ..core.logprobs import TOP_LOGPROBS_MAX
from ..core.stats import TokenEvent


def parse_logprobs(body: dict, kind: str, bad: Callable[..., Exception]) -> int | None:
    """How many alternatives each token reports (0: its own log-probability only); None: no logprobs."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if kind == "completion":
        if lp is None or lp is False:
            return None
        if isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= TOP_LOGPROBS_MAX:
            raise bad(f"'logprobs' must be an integer from 0 to {TOP_LOGPROBS_MAX} on completions (got "
                      f"{json.dumps(lp)})", "logprobs")
        return lp
    if lp is not None and not isinstance(lp, bool):
        raise bad(f"'logprobs' must be true or false (got {json.dumps(lp)})", "logprobs", "invalid_type")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= TOP_LOGPROBS_MAX:
            raise bad(f"'top_logprobs' must be an integer from 0 to {TOP_LOGPROBS_MAX} (got {json.dumps(top)})",
                      "top_logprobs")
        if top > 0 and not lp:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if lp else None


def _one(token: bytes, logprob: float) -> dict:
    return {"token": token.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(token)}


def entry(ev: TokenEvent, piece: Callable[[int], bytes]) -> dict:
    """A token's chat-completions logprobs entry: its text, log-probability, bytes and top alternatives."""
    return {**_one(piece(ev.token), ev.logprob),
            "top_logprobs": [_one(piece(t), lp) for t, lp in ev.top_logprobs]}


def chat_logprobs(entries: list[dict]) -> dict:
    return {"content": entries, "refusal": None}


def completion_logprobs(entries: list[dict], offset: int = 0) -> dict:
    """The legacy completions shape: parallel lists, top alternatives as {token: logprob}, text offsets from
    `offset` (the characters already sent in earlier chunks)."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [_by_text(e["top_logprobs"]) for e in entries], "text_offset": offsets}


def _by_text(top: list[dict]) -> dict[str, float]:
    """{token: logprob}; of two tokens that print alike (bytes of a cut UTF-8 sequence) the likelier keeps it."""
    out: dict[str, float] = {}
    for t in top:
        out.setdefault(t["token"], t["logprob"])
    return out


def wire(kind: str, entries: list[dict], offset: int = 0) -> dict:
    return chat_logprobs(entries) if kind == "chat" else completion_logprobs(entries, offset)
