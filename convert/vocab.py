"""Tokenizer files -> GGUF tokenizer metadata: byte-level BPE from tokenizer.json (Llama 3, Qwen2/2.5/3, SmolLM,
GPT-2 style) or SentencePiece BPE from tokenizer.model (Llama 2, Mistral v0.1; see spm.py).

llama.cpp re-implements each pre-tokenizer by name (`tokenizer.ggml.pre`). Upstream's converter finds the
name by hashing the Hugging Face tokenizer's output on a fixed text, which needs `transformers`; we read
the pre-tokenizer definition in tokenizer.json instead and map each known definition to llama.cpp's name.
Special ids, add-BOS, merges and the chat template come from gguf.SpecialVocab, as upstream.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import gguf

from ..errors import ConversionError
from .source import read_json
from .spm import load_spm

log = logging.getLogger("specq.convert")

# The pre-tokenizer regexes as they appear in tokenizer.json, and llama.cpp's name for each.
_QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLIT_REGEX_PRE = {_QWEN2: "qwen2", _LLAMA3: "llama-bpe", _QWEN35: "qwen35"}


@dataclass(frozen=True)
class Vocab:
    """A tokenizer as GGUF stores it: one text and type per embedding row."""

    tokens: list[str]
    types: list[int]
    n_real: int  # ids below this exist in the tokenizer; the rest are padding rows
    pre: str
    special: gguf.SpecialVocab
    source: str
    model: str = "gpt2"  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    scores: list[float] | None = None  # SentencePiece only: llama.cpp merges by score
    add_space_prefix: bool | None = None
    remove_extra_whitespaces: bool | None = None

    @property
    def n_rows(self) -> int:
        return len(self.tokens)


def detect_pre(tok: dict, where: str) -> str:
    """llama.cpp's pre-tokenizer name for the pre_tokenizer in tokenizer.json."""
    pre = tok.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        regex = (steps[0].get("pattern") or {}).get("Regex")
        if regex in SPLIT_REGEX_PRE:
            return SPLIT_REGEX_PRE[regex]
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    raise ConversionError(f"tokenizer pre-tokenizer not recognised ({where}: {kinds}); specq knows the Llama 3, "
                          "Qwen2/2.5/3, SmolLM and GPT-2 byte-level tokenizers")


def _looks_special(text: str) -> bool:
    # as llama.cpp's converter: added tokens like <|im_end|> are control tokens even when not flagged special
    return (text.startswith("<|") and text.endswith("|>")) or (text.startswith("<｜") and text.endswith("｜>"))


def load_vocab(path: Path, n_rows: int, where: str) -> Vocab:
    """The tokenizer of a checkpoint with n_rows embedding rows: byte-level BPE from tokenizer.json when it
    is one, else SentencePiece from tokenizer.model (Llama 2 checkpoints ship both)."""
    has_json, has_model = (path / "tokenizer.json").is_file(), (path / "tokenizer.model").is_file()
    tok = read_json(path / "tokenizer.json", "tokenizer.json") if has_json or not has_model else {}
    model = tok.get("model") or {}
    if model.get("type") == "BPE" and not model.get("byte_fallback") and "vocab" in model:
        return _load_bpe(path, tok, n_rows, where)
    if has_model:
        return _load_spm(path, n_rows, where)
    raise ConversionError(f"tokenizer is not a byte-level BPE ({where}: {model.get('type')}, byte_fallback="
                          f"{model.get('byte_fallback')}) and there is no tokenizer.model; SentencePiece "
                          "tokenizers (Llama 2, Mistral v0.1) are read from tokenizer.model: add it to the folder")


def _load_spm(path: Path, n_rows: int, where: str) -> Vocab:
    v = load_spm(path, n_rows, where)
    special = gguf.SpecialVocab(path, load_merges=False, n_vocab=n_rows)
    for kind, i in v.model.special_ids.items():
        # ids the HF files do not name come from the SentencePiece model itself
        special.special_token_ids.setdefault(kind, i)
    return Vocab(v.tokens, v.types, v.n_real, "default", special, where, model="llama", scores=v.scores,
                 add_space_prefix=v.add_space_prefix, remove_extra_whitespaces=v.model.remove_extra_whitespaces)


def _load_bpe(path: Path, tok: dict, n_rows: int, where: str) -> Vocab:
    pre = detect_pre(tok, where)
    model = tok["model"]
    by_id: dict[int, str] = {int(i): t for t, i in model["vocab"].items()}
    added = {int(a["id"]): a for a in tok.get("added_tokens", [])}
    for i, a in added.items():
        by_id[i] = a["content"]
    n_real = max(by_id) + 1
    if n_real > n_rows:
        raise ConversionError(f"tokenizer has {n_real} tokens but the model only {n_rows} embedding rows ({where}); "
                              "the tokenizer does not belong to this checkpoint")
    tokens, types = [], []
    for i in range(n_rows):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        text = by_id[i]
        tokens.append(text)
        if i in added and (added[i].get("special") or _looks_special(text)):
            types.append(gguf.TokenType.CONTROL)
        elif i in added:
            types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
    special = gguf.SpecialVocab(path, load_merges=True, n_vocab=n_rows)
    if not special.merges:
        raise ConversionError(f"tokenizer.json has no merges ({where}); the tokenizer is incomplete")
    return Vocab(tokens, types, n_real, pre, special, where)


def write_vocab(w: gguf.GGUFWriter, v: Vocab) -> None:
    w.add_vocab_size(v.n_rows)
    w.add_tokenizer_model(v.model)
    w.add_tokenizer_pre(v.pre)
    w.add_token_list(v.tokens)
    if v.scores is not None:
        w.add_token_scores(v.scores)
    w.add_token_types(v.types)
    if v.add_space_prefix is not None:
        w.add_add_space_prefix(v.add_space_prefix)
    if v.remove_extra_whitespaces is not None:
        w.add_remove_extra_whitespaces(v.remove_extra_whitespaces)
    v.special.add_to_gguf(w, quiet=True)


def first_difference(target: Vocab, draft: Vocab) -> tuple[int, str | None, str | None] | None:
    """The first id where the real vocabularies differ, with both texts (None where one has no token)."""
    n = max(target.n_real, draft.n_real)
    for i in range(n):
        a = target.tokens[i] if i < target.n_real else None
        b = draft.tokens[i] if i < draft.n_real else None
        if a != b:
            return i, a, b
    return None
