"""The pair manifest records the converter's version; a qwen35 pair from an older specq (or one that recorded
none) gets one line on stderr saying that converting it again improves fidelity (its norms and A were rounded
to the checkpoint's dtype before specq 0.2.0)."""

from __future__ import annotations

import logging
import re
import tomllib

import pytest
from typer.testing import CliRunner

from hfqwen35 import Qwen35Spec, write_checkpoint
from specq import __version__
from specq.cli.main import app
from specq.manifest import FLOAT32_TRANSFORMS_VERSION, MANIFEST_NAME, load_pair, reconvert_hint, version_tuple
from specq.convert.pipeline import convert_pair

HINT = "converting it again"


@pytest.fixture()
def qwen35_pair(tmp_path):
    src = write_checkpoint(tmp_path / "hf", Qwen35Spec(dtype="F32", mtp=False, seed=21))
    convert_pair(str(src), tmp_path / "pair", quant=None)
    return tmp_path / "pair"


def set_version(pair, version: str | None) -> None:
    """Rewrite the manifest's converter_version line (None: drop it, as specq before 0.2.0 wrote it)."""
    path = pair / MANIFEST_NAME
    text = re.sub(r'^converter_version = ".*"\n', "", path.read_text(encoding="utf-8"), flags=re.M)
    if version is not None:
        text = f'converter_version = "{version}"\n' + text
    path.write_text(text, encoding="utf-8")


def test_manifest_records_this_converter_and_loads_without_a_hint(qwen35_pair, caplog):
    doc = tomllib.loads((qwen35_pair / MANIFEST_NAME).read_text(encoding="utf-8"))
    assert doc["converter_version"] == __version__ and doc["target"]["architecture"] == "qwen35"
    assert version_tuple(__version__) >= version_tuple(FLOAT32_TRANSFORMS_VERSION)
    with caplog.at_level(logging.WARNING, logger="specq"):
        load_pair(qwen35_pair)
    assert not [r for r in caplog.records if HINT in r.getMessage()]


@pytest.mark.parametrize("version", [None, "0.1.0", "0.1.9.dev3"])
def test_older_qwen35_pair_prints_one_hint_line(qwen35_pair, version):
    set_version(qwen35_pair, version)
    r = CliRunner().invoke(app, ["bench", "--pair", str(qwen35_pair), "--drafter", "ngram", "--no-baseline",
                                 "--prompt", "def fibonacci(n):", "--n-predict", "4", "--ctx", "64", "--json", "-"])
    assert r.exit_code == 0, r.output
    hints = [line for line in r.stderr.splitlines() if HINT in line]
    assert len(hints) == 1, r.stderr
    assert str(qwen35_pair / MANIFEST_NAME) in hints[0] and FLOAT32_TRANSFORMS_VERSION in hints[0]
    assert (version or "recorded no converter_version") in hints[0]


def test_current_pair_prints_no_hint(qwen35_pair):
    r = CliRunner().invoke(app, ["bench", "--pair", str(qwen35_pair), "--drafter", "ngram", "--no-baseline",
                                 "--prompt", "def fibonacci(n):", "--n-predict", "4", "--ctx", "64", "--json", "-"])
    assert r.exit_code == 0, r.output
    assert HINT not in r.stderr


@pytest.mark.parametrize("doc, hinted", [
    ({"target": {"architecture": "qwen35"}}, True),
    ({"target": {"architecture": "qwen35moe"}, "converter_version": "0.1.0"}, True),
    ({"target": {"architecture": "llama"}, "draft": {"architecture": "qwen35"}}, True),  # a qwen35 draft
    ({"target": {"architecture": "qwen35"}, "converter_version": "not a version"}, True),
    ({"target": {"architecture": "qwen35"}, "converter_version": FLOAT32_TRANSFORMS_VERSION}, False),
    ({"target": {"architecture": "qwen35"}, "converter_version": "0.10.0"}, False),  # numbers, not strings
    ({"target": {"architecture": "qwen35"}, "converter_version": "1.0.0"}, False),
    ({"target": {"architecture": "llama"}}, False),  # no value transforms were rounded there
    ({"target": {"architecture": "gemma3"}}, False),  # gemma3's norm + 1 was always float32
])
def test_which_pairs_get_the_hint(tmp_path, doc, hinted):
    hint = reconvert_hint(doc, tmp_path / MANIFEST_NAME)
    assert (hint is not None) == hinted
    if hint:
        assert "\n" not in hint and str(tmp_path / MANIFEST_NAME) in hint
