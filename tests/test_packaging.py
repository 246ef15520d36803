"""The built wheel: only `specq` lands in site-packages, with its data files and the console script."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_has_only_the_specq_package_and_its_data(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
                   check=True, capture_output=True)
    (wheel,) = tmp_path.glob("specq-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"specq"}  # no generic top-level names
    assert not any(t in tops for t in ("cli", "native", "convert", "models", "tests", "benchmarks"))
    for sub in ("cli", "convert", "native", "models"):
        assert f"specq/{sub}/__init__.py" in names
    assert "specq/errors.py" in names and "specq/__init__.py" in names
    assert sum(n.startswith("specq/models/") and n.endswith(".toml") for n in names) >= 7  # the presets
    assert "specq/models/prompts/default.jsonl" in names
    assert not any(n.startswith("specq/tests/") or n.startswith("specq/benchmarks/") for n in names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "specq = specq.cli.main:main" in zipfile.ZipFile(wheel).read(entry).decode()
