"""SentencePiece `tokenizer.model` -> GGUF "llama" vocabulary (Llama 2, Mistral v0.1, TinyLlama style).

tokenizer.model is a protobuf message (sentencepiece_model.proto). We read the few fields llama.cpp needs
with a small wire-format reader, so conversion needs neither sentencepiece nor protobuf at run time.
Token types, scores and added tokens follow llama.cpp's converter (`_create_vocab_sentencepiece`).
"""

from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import gguf

from ..errors import ConversionError

log = logging.getLogger("specq.convert")

# ModelProto fields; SentencePiece piece types share gguf.TokenType's numbers (NORMAL=1 ... BYTE=6).
_PIECES, _TRAINER, _NORMALIZER = 1, 2, 3
_MODEL_TYPES = {1: "unigram", 2: "bpe", 3: "word", 4: "char"}
ADDED_SCORE = -1000.0  # llama.cpp's converter: score of added tokens and of padding past the pieces
UNSET_SCORE = -10000.0


@dataclass(frozen=True)
class SpmModel:
    """The parts of a tokenizer.model that decide how llama.cpp tokenizes."""

    pieces: list[str]
    scores: list[float]
    types: list[int]
    model_type: str
    add_dummy_prefix: bool
    remove_extra_whitespaces: bool
    normalizes: bool  # a normalization rule (e.g. NFKC) that llama.cpp does not apply
    special_ids: dict[str, int]  # unk/bos/eos/pad ids from the trainer spec (absent when negative)


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        b = buf[i]
        value |= (b & 0x7F) << shift
        i += 1
        if not b & 0x80:
            return value, i
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) for each field of one message: ints for varints, bytes otherwise."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        wire = key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            value, i = buf[i:i + n], i + n
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i:i + n], i + n
        else:
            raise ValueError(f"unsupported wire type {wire}")
        if i > len(buf):
            raise ValueError("truncated field")
        yield key >> 3, value


def parse_model(data: bytes) -> SpmModel:
    """Parse a serialized ModelProto; ValueError when it is not one."""
    pieces, scores, types = [], [], []
    trainer: dict[int, int | bytes] = {}
    normalizer: dict[int, int | bytes] = {}
    for field, value in _fields(data):
        if field == _PIECES and isinstance(value, bytes):
            p = dict(_fields(value))
            pieces.append(bytes(p.get(1, b"")).decode("utf-8"))
            scores.append(struct.unpack("<f", p[2])[0] if 2 in p else 0.0)
            types.append(int(p.get(3, gguf.TokenType.NORMAL)))
        elif field == _TRAINER and isinstance(value, bytes):
            trainer = dict(_fields(value))
        elif field == _NORMALIZER and isinstance(value, bytes):
            normalizer = dict(_fields(value))
    if not pieces:
        raise ValueError("no pieces")

    def signed(v: int) -> int:  # int32 fields are varints in two's complement over 64 bits
        return v - (1 << 64) if v >= 1 << 63 else v

    # trainer spec ids: unk_id 40, bos_id 41, eos_id 42, pad_id 43 (defaults 0, 1, 2, -1)
    ids = {name: signed(int(trainer.get(num, default)))
           for name, num, default in (("unk", 40, 0), ("bos", 41, 1), ("eos", 42, 2), ("pad", 43, -1))}
    return SpmModel(
        pieces, scores, types,
        model_type=_MODEL_TYPES.get(int(trainer.get(3, 1)), "?"),
        add_dummy_prefix=bool(normalizer.get(3, 1)),
        remove_extra_whitespaces=bool(normalizer.get(4, 1)),
        normalizes=bool(normalizer.get(2)) or bool(normalizer.get(6)),
        special_ids={k: v for k, v in ids.items() if 0 <= v < len(pieces)},
    )


def read_model(path: Path, where: str) -> SpmModel:
    try:
        m = parse_model((path / "tokenizer.model").read_bytes())
    except (ValueError, UnicodeDecodeError, struct.error) as e:
        raise ConversionError(f"tokenizer.model is not a SentencePiece model ({where}: {e}); re-download it, "
                              "or remove it if the checkpoint's tokenizer.json is complete")
    if m.model_type != "bpe":
        # llama.cpp's "llama" tokenizer merges pieces by score (SentencePiece BPE); Viterbi models would differ.
        raise ConversionError(f"SentencePiece {m.model_type} tokenizer ({where}); specq converts SentencePiece "
                              "BPE tokenizers (Llama 2, Mistral v0.1) only")
    if m.normalizes:
        log.warning("tokenizer.model of %s normalizes text (NFKC or a custom rule) and llama.cpp does not: "
                    "unnormalized text may tokenize differently", where)
    return m


def _looks_special(text: str) -> bool:
    # llama.cpp's does_token_look_special, for added tokens not flagged special (Gemma's <mask>, <unusedN>...)
    return (text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<｜") and text.endswith("｜>"))
            or (text.startswith("<unused") and text.endswith(">")))


def _read_optional_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ConversionError(f"{path.name} is not valid JSON ({path}: {e}); fix or re-download it")


@dataclass(frozen=True)
class SpmVocab:
    tokens: list[str]
    scores: list[float]
    types: list[int]
    n_real: int
    model: SpmModel
    add_space_prefix: bool


def load_spm(path: Path, n_rows: int, where: str) -> SpmVocab:
    """Tokens, scores and types for n_rows embedding rows, as llama.cpp's converter builds them."""
    m = read_model(path, where)
    if len(m.pieces) > n_rows:
        raise ConversionError(f"tokenizer.model has {len(m.pieces)} pieces but the model only {n_rows} embedding "
                              f"rows ({where}); the tokenizer does not belong to this checkpoint")
    tokens = [f"[PAD{i}]" for i in range(n_rows)]
    scores = [UNSET_SCORE] * n_rows
    types = [int(gguf.TokenType.UNUSED)] * n_rows
    tokens[:len(m.pieces)], scores[:len(m.pieces)], types[:len(m.pieces)] = m.pieces, m.scores, m.types
    n_real = len(m.pieces)
    left_out: set[int] = set()

    def add(i: int, text: str, kind: int) -> None:
        nonlocal n_real
        if i < 0:
            raise ConversionError(f"added token {text!r} has id {i} ({where}); the tokenizer files are corrupt")
        if i >= n_rows:
            # as llama.cpp's converter: Gemma-3-1B lists <image_soft_token> past its 262144 rows
            if i not in left_out:
                log.warning("added token %r has id %d, beyond the %d embedding rows (%s): left out", text, i, n_rows,
                            where)
            left_out.add(i)
            return
        tokens[i], scores[i], types[i] = text, ADDED_SCORE, kind
        n_real = max(n_real, i + 1)

    for text, i in _read_optional_json(path / "added_tokens.json").items():
        add(int(i), text, gguf.TokenType.USER_DEFINED)
    cfg = _read_optional_json(path / "tokenizer_config.json")
    for i, data in (cfg.get("added_tokens_decoder") or {}).items():
        text = data["content"]
        if data.get("special") or _looks_special(text):
            add(int(i), text, gguf.TokenType.CONTROL)
        else:
            add(int(i), text.replace("\u2581", " "), gguf.TokenType.USER_DEFINED)  # as llama.cpp: pre-normalized
    prefix = cfg.get("add_prefix_space")
    return SpmVocab(tokens, scores, types, n_real, m, m.add_dummy_prefix if prefix is None else bool(prefix))
