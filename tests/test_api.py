"""The public Python API (docs/python-api.md), imported from `specq` alone, on the demo pair: greedy speculative
output equal to the target alone with drafts accepted, streaming, a batch of two sequences, a JSON-schema answer,
the one-thread rule, and the documented names being exactly the package's public ones."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest

import specq

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


@pytest.fixture(scope="module")
def pair():
    with specq.load("demo", ctx=512, threads=2, parallel=2) as p:
        yield p


def not_degenerate(tokens: list[int]) -> bool:
    return len(set(tokens)) > 5


def test_greedy_generation_is_the_targets_own_with_drafts_accepted(pair):
    fast = pair.generate(PROMPT, max_tokens=48)
    alone = pair.generate(PROMPT, max_tokens=48, speculative=False)
    assert isinstance(fast, specq.Result) and isinstance(fast.stats, specq.GenerationStats)
    assert not_degenerate(alone.tokens) and fast.tokens == alone.tokens and fast.text == alone.text
    assert fast.stats.n_drafted > 0 and fast.stats.n_accepted > 0 and alone.stats.n_drafted == 0
    assert pair.detokenize(pair.tokenize(PROMPT)) == PROMPT and pair.detokenize(fast.tokens) == fast.text


def test_streaming_yields_each_token_and_the_result_after(pair):
    stream = pair.stream(PROMPT, max_tokens=32)
    assert stream.result is None
    events = list(stream)
    assert all(isinstance(e, specq.TokenEvent) for e in events)
    assert [e.token for e in events] == stream.result.tokens and "".join(e.text for e in events) == stream.result.text
    assert any(e.from_draft for e in events) and stream.result.stats.n_accepted > 0
    assert stream.result.tokens == pair.generate(PROMPT, max_tokens=32, speculative=False).tokens


def test_a_stream_stopped_early_still_gives_its_result(pair):
    stream = pair.stream(PROMPT, max_tokens=32)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert stream.result is not None and 4 <= len(stream.result.tokens) < 32
    assert stream.result.stats.stop_reason == "interrupted"


def test_a_batch_of_two_sequences_gives_each_ones_own_answer(pair):
    prompts = [PROMPT, "Once upon a time, there"]
    results = pair.generate_batch(prompts, max_tokens=32)
    alone = [pair.generate(p, max_tokens=32, speculative=False) for p in prompts]
    assert [r.tokens for r in results] == [a.tokens for a in alone] and results[0].tokens != results[1].tokens
    assert all(not_degenerate(r.tokens) for r in results) and sum(r.stats.n_accepted for r in results) > 0
    assert all(r.stats.n_drafted > 0 for r in results)


def test_a_json_schema_constrains_the_answer(pair):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
              "required": ["colour"], "additionalProperties": False}
    prompt = pair.apply_chat_template([{"role": "user", "content": "Pick a colour and answer as JSON."}])
    assert prompt.rstrip().endswith("assistant")  # the template ends where the answer begins
    got = pair.generate(prompt, max_tokens=40, json_schema=schema)
    assert json.loads(got.text)["colour"] in {"red", "green", "blue"} and set(json.loads(got.text)) == {"colour"}
    assert got.stats.stop_reason == "eog" and got.stats.n_drafted > 0


def test_another_thread_gets_a_clear_error(pair):
    caught = []
    t = threading.Thread(target=lambda: caught.append(pytest.raises(specq.WrongThreadError, pair.generate, "x")))
    t.start()
    t.join(60)
    assert caught and "loaded on thread" in str(caught[0].value)


def test_the_documented_names_are_the_public_ones():
    """Every name docs/python-api.md lists as `specq.NAME` exists, they are `specq.__all__` (the version aside),
    and the page documents nothing under specq.native as public."""
    text = (ROOT / "docs" / "python-api.md").read_text(encoding="utf-8")
    table = text.split("| name | what it is |")[1].split("\n\n")[0]
    documented = set(re.findall(r"^\| `specq\.(\w+)", table, re.M))
    assert documented == set(specq.__all__) - {"__version__"}
    assert all(getattr(specq, n) is not None for n in documented)
    assert not re.search(r"`specq\.native[.\w]*`", table)
    with pytest.raises(AttributeError):
        specq.Engine  # noqa: B018 - internal names are not reachable from the face


def test_bad_input_is_one_actionable_error(tmp_path):
    with pytest.raises(specq.SpecqError, match="no such model file"):
        specq.load(tmp_path / "missing.gguf")
    (tmp_path / "t.gguf").write_bytes(b"")
    with pytest.raises(specq.SpecqError, match="needs a draft model"):
        specq.load(tmp_path / "t.gguf", drafter="model")
    with pytest.raises(specq.SpecqError, match="--drafter must be"):
        specq.load(tmp_path / "t.gguf", drafter="nonesuch")


def test_a_pair_folder_and_a_preset_name_open_with_their_suggestions(tmp_path, monkeypatch, tiny_target):
    """load(FOLDER) reads the folder's manifest (its drafter and draft-max); load(PRESET) opens that preset's pair
    converted into the cache folder, and before it is converted says how, in one line."""
    import shutil

    from specq.manifest import sha256_file, write_manifest  # a pair folder as `specq convert` writes one

    monkeypatch.setenv("SPECQ_CACHE_DIR", str(tmp_path))
    with pytest.raises(specq.SpecqError, match=r"not converted yet: run `specq convert --preset qwen3-8b --out "):
        specq.load("qwen3-8b")
    folder = tmp_path / "pairs" / "qwen3-8b"
    folder.mkdir(parents=True)
    shutil.copy(tiny_target, folder / "t.gguf")
    write_manifest(folder, {"file": "t.gguf", "sha256": sha256_file(folder / "t.gguf")}, None,
                   {"draft_max": 3, "drafter": "ngram", "ctx": 256})
    for where in ("qwen3-8b", folder):
        with specq.load(where, threads=1) as p:
            r = p.generate("The quick brown fox", max_tokens=16)
            assert len(r.tokens) == 16 and r.stats.speculative  # the manifest's drafter: n-grams, no draft model
            with pytest.raises(specq.SpecqError, match="ctx 256"):  # the manifest's context
                p.generate("fox " * 300, max_tokens=4)
