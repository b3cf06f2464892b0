"""Command-line conveniences: --version, "did you mean" for --method, whole method
descriptions, and the Makefile's torch index."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import lowcomm
from lowcomm.strategies import STRATEGIES, strategy_class


def _lowcomm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lowcomm", *args],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "80"},
    )  # fmt: skip


def test_version() -> None:
    result = _lowcomm("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"lowcomm {lowcomm.__version__}"


def test_a_mistyped_method_gets_did_you_mean() -> None:
    with pytest.raises(ValueError, match="did you mean diloco\\?"):
        strategy_class("dilco")
    with pytest.raises(ValueError, match="did you mean streaming_diloco\\?"):
        strategy_class("streaming-diloco")
    with pytest.raises(ValueError) as caught:
        strategy_class("xyz")
    assert "did you mean" not in str(caught.value)
    result = _lowcomm("train", "--method", "local_sdg")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("lowcomm: error: --method:") and "did you mean local_sgd?" in line


def test_methods_lists_every_description_whole() -> None:
    result = _lowcomm("methods")
    assert result.returncode == 0, result.stderr
    entries: dict[str, str] = {}
    for line in result.stdout.splitlines():
        if line[:1].strip():
            name, _, text = line.partition(" ")
            entries[name] = text.strip()
        else:
            entries[name] += " " + line.strip()
    assert set(entries) == set(STRATEGIES)
    for name, cls in STRATEGIES.items():
        paragraph = (cls.__doc__ or "").strip().split("\n\n")[0]
        assert entries[name] == " ".join(part.strip() for part in paragraph.splitlines()), name
    assert all(len(line) <= 80 for line in result.stdout.splitlines())


@pytest.mark.parametrize("index", [None, "https://download.pytorch.org/whl/cpu"])
def test_makefile_installs_torch_from_the_index_asked_for(
    repo_root: Path, tmp_path: Path, index: str | None
) -> None:
    command = ["make", "-n", "-C", str(repo_root), f"VENV={tmp_path / 'venv'}",
               f"{tmp_path / 'venv'}/.torch"]  # fmt: skip
    if index is not None:
        command.append(f"TORCH_INDEX_URL={index}")
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    [install] = [line for line in result.stdout.splitlines() if "pip install" in line]
    assert "torch==" in install
    if index is None:
        assert "--index-url" not in install
    else:
        assert f'--index-url "{index}"' in install
