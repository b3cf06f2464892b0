"""Regression tier, mixed precision: one run with ``--precision bf16-mixed`` and
``--comm-dtype bf16`` pinned like every method's run in ``test_regression.py`` (the same
setup, the same tolerances), so a change to what travels in bf16 or to the autocast region
shows up as moved numbers. Its file lives in ``tests/regression/precision/``; regenerate
with ``LOWCOMM_REGEN=1 pytest tests/test_regression_precision.py`` (``make regen-regression``
runs both) and commit saying why the numbers moved."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from lowcomm.data import DataConfig
from lowcomm.launch import spawn_workers
from test_regression import DESCRIPTION, REGEN, STORE, _compare, _dumps, _merge, _record
from test_regression import regression_config as base_config

pytestmark = pytest.mark.regression

PRECISION_STORE = STORE / "precision"

#: (key, method): each trained with bf16-mixed compute and bf16 gradients/pseudo-gradients.
RUNS = [("ddp-bf16", "ddp"), ("diloco-bf16", "diloco")]


def _run_all(base: str) -> dict[str, dict[str, Any] | str]:
    results: dict[str, dict[str, Any] | str] = {}
    for key, method in RUNS:
        config = dataclasses.replace(
            base_config(method, Path(base) / key),
            numerics=dataclasses.replace(
                base_config(method, Path(base) / key).numerics, precision="bf16-mixed"
            ),
            comm=dataclasses.replace(base_config(method, Path(base) / key).comm, comm_dtype="bf16"),
        )
        try:
            results[key] = _record(config)
        except Exception as error:
            results[key] = f"{type(error).__name__}: {error}"
    return results


@pytest.fixture(scope="module")
def fresh_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any] | str]:
    from lowcomm.data import prepare_corpus

    base = tmp_path_factory.mktemp("regression-precision")
    prepare_corpus(DataConfig(micro_batch_size=2))
    return _merge(spawn_workers(_run_all, 2, (str(base),), timeout_s=240))


@pytest.mark.parametrize("key", [key for key, _ in RUNS])
def test_bf16_run_matches_stored_numbers(
    key: str, fresh_runs: dict[str, dict[str, Any] | str]
) -> None:
    got = fresh_runs[key]
    assert isinstance(got, dict), f"{key} failed: {got}"
    path = PRECISION_STORE / f"{key}.json"
    setup = f"{DESCRIPTION}; --precision bf16-mixed --comm-dtype bf16"
    if REGEN:
        PRECISION_STORE.mkdir(parents=True, exist_ok=True)
        path.write_text(_dumps({"run": key, "setup": setup, **got}))
        return
    assert path.exists(), f"{path} is missing: regenerate it and commit the new file"
    problems = _compare(key, got, json.loads(path.read_text()))
    assert not problems, (
        f"{key} moved from {path.name} ({len(problems)} differences; first ones below). If "
        f"intended, regenerate and commit saying why the numbers moved.\n"
        + "\n".join(problems[:15])
    )
