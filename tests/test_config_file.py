"""Config files (`lowcomm train --config FILE`, `--print-config`) and the grouped --help."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from _cli import TINY, lowcomm

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

#: Flags that run the command in this process (tests/_cli.py), and change no key checked.
INLINE = ("--workers", "2")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples" / "configs").glob("*.toml"))

#: Flags that leave many options off their defaults: a method group, nested components, a
#: None over a non-None default, a tuple, a float given as an integer.
FLAGS = [
    "--method", "streaming_diloco", "--diloco.sync-every", "2", "--diloco.fragments", "1",
    "--diloco.quantization", "fp8", "--max-grad-norm", "None", "--optim.lr", "2",
    "--optim.betas", "0.8", "0.9", "--schedule.warmup-steps", "1", "--speed-factors", "1", "2",
    "--network", "slow-wan", "--latency-ms", "20", "--steps", "3", *TINY,
    "--workers-per-process", "2",
]  # fmt: skip


def _parsed(flags: list[str]) -> dict[str, object]:
    """The TrainConfig the command line parses ``flags`` to, as a dict."""
    import tyro

    from lowcomm.cli import _TYRO
    from lowcomm.config import TrainConfig

    return tyro.cli(TrainConfig, args=flags, config=_TYRO).to_dict()


def _metrics(run: Path) -> list[tuple[object, ...]]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["train_loss"], r["val_loss"]) for r in records]


def test_print_config_read_back_gives_the_same_config(tmp_path: Path) -> None:
    from lowcomm.config_file import read_config

    printed = lowcomm("train", *FLAGS, "--print-config")
    assert printed.returncode == 0, printed.stderr
    path = tmp_path / "run.toml"
    path.write_text(printed.stdout)
    assert read_config(str(path)).to_dict() == _parsed(FLAGS)
    assert tomllib.loads(printed.stdout)["diloco"]["quantization"] == "fp8"
    # The other methods' groups are left out; a None over a default is spelled "None".
    assert "desloc" not in tomllib.loads(printed.stdout)
    assert tomllib.loads(printed.stdout)["run"]["max_grad_norm"] == "None"
    again = lowcomm("train", "--config", str(path), *INLINE, "--print-config")
    assert again.returncode == 0, again.stderr
    assert again.stdout == printed.stdout
    # A flag beside --config overrides the file's value, before or after it.
    for order in (("--steps", "7", "--config", str(path)), ("--config", str(path), "--steps", "7")):
        over = lowcomm("train", *order, "--diloco.sync-every", "5", "--print-config")
        assert over.returncode == 0, over.stderr
        values = tomllib.loads(over.stdout)
        assert values["run"]["steps"] == 7 and values["diloco"]["sync_every"] == 5
        assert values["optim"]["lr"] == 2.0


@pytest.mark.slow
def test_a_printed_config_and_a_run_directory_rerun_the_flags_run(tmp_path: Path) -> None:
    printed = lowcomm("train", *FLAGS, "--print-config")
    assert printed.returncode == 0, printed.stderr
    path = tmp_path / "run.toml"
    path.write_text(printed.stdout)
    runs = {
        "flags": ("train", *FLAGS, "--out", str(tmp_path / "flags")),
        "file": ("train", "--config", str(path), "--out", str(tmp_path / "file")),
    }
    for name, args in runs.items():
        result = lowcomm(*args)
        assert result.returncode == 0, f"{name}: {result.stderr}"
    # A run directory's config.json, passed back, runs the same again.
    rerun = lowcomm("train", "--config", str(tmp_path / "flags"), "--out", str(tmp_path / "again"))
    assert rerun.returncode == 0, rerun.stderr
    reference = _metrics(tmp_path / "flags")
    assert len(reference) == 3
    assert _metrics(tmp_path / "file") == reference
    assert _metrics(tmp_path / "again") == reference
    summaries = [json.loads((tmp_path / n / "summary.json").read_text()) for n in ("flags", "file")]
    assert summaries[0]["bytes_sent_per_worker"] == summaries[1]["bytes_sent_per_worker"]
    assert summaries[0]["modeled_time_s"] == summaries[1]["modeled_time_s"]


@pytest.mark.slow
@pytest.mark.parametrize("example", EXAMPLES, ids=[path.stem for path in EXAMPLES])
def test_each_example_config_runs_a_step(tmp_path: Path, example: Path) -> None:
    values = tomllib.loads(example.read_text())
    # FSDP's collectives need a process per rank; the others run their workers as threads.
    processes = values.get("placement", {}).get("worker_sharding") == "fsdp"
    out = tmp_path / "run"
    result = lowcomm(
        "train", "--config", str(example), *TINY, "--model.n-layer", "4", "--steps", "1",
        "--out", str(out), processes=processes, timeout=280,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    saved = json.loads((out / "config.json").read_text())
    assert saved["method"] == values["method"]
    for group, options in values.items():
        if isinstance(options, dict) and group in ("diloco", "desloc"):
            for key, value in options.items():
                assert saved[group][key] == value, (group, key)
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1


def test_the_example_configs_are_the_four_the_docs_name() -> None:
    names = {path.stem for path in EXAMPLES}
    assert names == {"diloco-wan", "streaming-diloco-fp8", "desloc", "sharded-fsdp"}
    page = (ROOT / "docs" / "config-files.md").read_text()
    for name in names:
        assert f"examples/configs/{name}.toml" in page


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('method = "diloco"\n[diloco]\nsync_evry = 4\n', "diloco.sync_evry (did you mean diloco.sync_every?)"),
        ("micro_batch_size = 4\n", "micro_batch_size (did you mean data.micro_batch_size?)"),
        ("stpes = 4\n", "stpes (did you mean run.steps?)"),
    ],
)  # fmt: skip
def test_an_unknown_key_is_one_line_naming_the_closest_known_one(
    tmp_path: Path, text: str, named: str
) -> None:
    path = tmp_path / "run.toml"
    path.write_text(text)
    result = lowcomm("train", "--config", str(path), *INLINE, "--print-config")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"unknown key {named}" in lines[0]
    assert str(path) in lines[0]
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("text", "key", "wanted"),
    [
        ('[run]\nsteps = "ten"\n', "run.steps", "a whole number"),
        ('steps = "ten"\n', "run.steps", "a whole number"),  # the flat shape
        ("[model]\nn_layer = 1.5\n", "model.n_layer", "a whole number"),
        ('[comm]\nclock = "wall"\n', "comm.clock", 'one of "real", "virtual"'),
        ("[optim]\nbetas = [0.9]\n", "optim.betas", "a list of 2 numbers"),
        ("run.overwrite = 1\n", "run.overwrite", "true or false"),
        ("model = 3\n", "model", "is not a table"),
        ('data = "corpus.txt"\n', "data", "data.data = ..."),
    ],
)
def test_a_value_of_the_wrong_type_is_one_line_naming_the_key(
    tmp_path: Path, text: str, key: str, wanted: str
) -> None:
    path = tmp_path / "run.toml"
    path.write_text(text)
    result = lowcomm("train", "--config", str(path), *INLINE, "--print-config")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f": {key} = " in lines[0] and wanted in lines[0]


def test_a_file_that_is_not_toml_or_is_missing_is_one_line(tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text("steps = = 3\n")
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"\xd4\xff\x00 steps = 3\n")
    for path, words in (
        (broken, "not valid TOML"),
        (tmp_path / "none.toml", "cannot read"),
        (binary, "is not text (byte 0 is not UTF-8)"),
    ):
        result = lowcomm("train", "--config", str(path), *INLINE, "--print-config")
        assert result.returncode == 2
        assert len(result.stderr.strip().splitlines()) == 1 and words in result.stderr


def test_a_run_directory_is_read_as_a_new_run_not_resumed_nor_cleared(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    saved = {"method": "desloc", "steps": 9, "overwrite": True, "resume": str(run)}
    (run / "config.json").write_text(json.dumps(saved))
    result = lowcomm("train", "--config", str(run), *INLINE, "--print-config")
    assert result.returncode == 0, result.stderr
    values = tomllib.loads(result.stdout)
    assert values["method"] == "desloc" and values["run"]["steps"] == 9
    assert values["run"]["overwrite"] is False and "resume" not in values["run"]


def test_options_of_another_method_in_the_file_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('method = "ddp"\n[desloc]\nparam_period = 4\n')
    result = lowcomm("train", "--config", str(path), *INLINE, "--print-config")
    assert result.returncode == 2
    assert "[desloc] holds options of desloc" in result.stderr
    assert "not of method ddp" in result.stderr
    # At their defaults they are ignored, as a run directory's config.json holds every group.
    path.write_text('method = "ddp"\n[desloc]\nparam_period = 16\n')
    assert lowcomm("train", "--config", str(path), *INLINE, "--print-config").returncode == 0


def test_help_is_grouped_short_and_names_every_option(monkeypatch: pytest.MonkeyPatch) -> None:
    from lowcomm.cli import TRAIN_FILE_OPTIONS, option_flags
    from lowcomm.config import TrainConfig

    # The help wraps to the terminal (70-100 columns): the budget is for a 100-column one.
    monkeypatch.setenv("COLUMNS", "100")
    result = lowcomm("train", "--help")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) <= 340
    assert max(len(line) for line in lines) <= 100
    named = {word for line in lines for word in line.split() if word.startswith("--")}
    missing = [f for f in [*option_flags(TrainConfig), *TRAIN_FILE_OPTIONS] if f not in named]
    assert not missing
    titles = [line for line in lines if line and not line.startswith(" ") and line.endswith(":")]
    for title in ("Model:", "Data:", "Optimizer:", "Network:", "Clock:", "Workers and placement:"):
        assert title in titles
    assert any(title.startswith("Method options --diloco.*") for title in titles)
    assert "docs/options.md" in result.stdout


def test_no_help_line_keeps_a_docstring_source_line_break() -> None:
    from lowcomm.options_help import groups, short_help

    # The docstrings' hard line breaks are the source's, not the text's: none survives.
    for group in groups():
        for option in group.options:
            assert "\n" not in short_help(option, option.flag[2:].replace("-", "_"))


def test_docs_options_page_is_current() -> None:
    from lowcomm.options_help import options_markdown

    page = ROOT / "docs" / "options.md"
    assert page.read_text() == options_markdown(), (
        "docs/options.md is stale: python -m lowcomm.options_help > docs/options.md"
    )
