"""Helpers shared by the tests that run the command line (in this process where they can,
else in a subprocess)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path


def small_flags(*, n_layer: int = 1, plot: bool = False) -> list[str]:
    """`lowcomm train` flags for a run that finishes in seconds: 2 workers, a 1-layer (or
    ``n_layer``) GPT 64 wide, 32-token blocks, micro-batches of 4, a 2-batch validation every
    2 steps, no progress bar, no loss.png unless ``plot`` (matplotlib's import and drawing
    are about 1.5 s of CPU per run)."""
    return [
        "--workers", "2", "--model.n-layer", str(n_layer), "--model.n-embd", "64",
        "--model.n-head", "2", "--model.block-size", "32", "--micro-batch-size", "4",
        "--eval-batches", "2", "--eval-every", "2", "--progress", "False", "--plot", str(plot),
    ]  # fmt: skip


SMALL = small_flags()

#: Smaller still, for runs that only need to exist (checkpoints, refusals, signals): a 1-layer GPT
#: 32 wide, 16-token blocks, micro-batches of 2, validation only at the end, and a declared 0.01 s
#: per micro-batch on the virtual clock.
TINY = (
    "--workers", "2", "--model.n-layer", "1", "--model.n-embd", "32", "--model.n-head", "2",
    "--model.block-size", "16", "--micro-batch-size", "2", "--eval-every", "100",
    "--eval-batches", "2", "--progress", "False", "--plot", "False",
    "--seconds-per-microbatch", "0.01",
)  # fmt: skip


def torchrun(tmp_path: Path) -> list[str]:
    """The ``torchrun`` beside this interpreter, its logs under ``tmp_path`` (by default each
    launch leaves a ``torchelastic_*`` folder in the system's temporary directory)."""
    command = Path(sys.executable).with_name("torchrun")
    assert command.exists(), f"torchrun ships with torch: no {command}"
    return [str(command), "--log-dir", str(tmp_path / "torchrun-logs")]


#: Options whose runs need a process per worker (refused with --workers-per-process > 1).
_PROCESS_ONLY = ("--worker-sharding", "--compile", "--device", "--workers-per-process")


def in_one_process(args: tuple[str, ...]) -> tuple[str, ...]:
    """``lowcomm train ARGS`` with its workers in one process (``--workers-per-process M``
    for the last ``--workers M``): these tests check a run's numbers, files and messages, and
    the two placements give the same ones (tests/test_regression.py checks every method in
    both). Left as they are: other commands, runs without --workers, runs whose options need
    a process per worker, and every run where LOWCOMM_TEST_PROCESSES=1 (the whole CLI suite
    in process mode). The process machinery has tests of its own (test_interrupt,
    test_reliability, test_cli's torchrun, test_startup, test_selftest)."""
    if not args or args[0] != "train" or os.environ.get("LOWCOMM_TEST_PROCESSES") == "1":
        return args
    if any(arg.split("=", 1)[0] in _PROCESS_ONLY for arg in args):
        return args
    workers = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == "--workers"]
    if not workers:
        return args
    return (*args, "--workers-per-process", workers[-1])


#: Commands that start no process of their own when their workers are threads.
_INLINE_COMMANDS = ("train", "plan", "eval", "generate", "methods")


def _runs_inline(args: tuple[str, ...]) -> bool:
    """Whether ``lowcomm ARGS`` starts no process (a ``train`` run only with its workers in
    this process): then the test runs it here, saving an interpreter's start and torch's
    import (3-4 s of a core) per command."""
    if not args or args[0] not in _INLINE_COMMANDS or os.environ.get("LOWCOMM_TEST_PROCESSES"):
        return False
    if args[0] != "train":
        return True
    per_process = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == "--workers-per-process"]
    workers = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == "--workers"]
    return bool(per_process and workers) and per_process[-1] == workers[-1]


def _inline(args: tuple[str, ...], cwd: Path | None) -> subprocess.CompletedProcess[str]:
    """``python -m lowcomm ARGS`` run in this process, as the subprocess would: its exit status
    (SystemExit's code; 1 and the traceback for an uncaught exception) and what it wrote to
    stdout and stderr, from Python and from C (the file descriptors too)."""
    from lowcomm.cli import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.ExitStack() as stack:
        fd_files = [stack.enter_context(tempfile.TemporaryFile()) for _ in range(2)]
        saved = [os.dup(1), os.dup(2)]
        for fd, file in zip((1, 2), fd_files, strict=True):
            os.dup2(file.fileno(), fd)
        previous = Path.cwd()
        try:
            if cwd is not None:
                os.chdir(cwd)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    main(list(args))
                except SystemExit as stop:
                    code = (
                        stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
                    )
                    if isinstance(stop.code, str):
                        print(stop.code, file=sys.stderr)
                except Exception:  # as the interpreter would: the traceback, status 1
                    traceback.print_exc()
                    code = 1
        finally:
            os.chdir(previous)
            for fd, copy in zip((1, 2), saved, strict=True):
                os.dup2(copy, fd)
                os.close(copy)
        written = []
        for file in fd_files:
            file.seek(0)
            written.append(file.read().decode(errors="replace"))
    return subprocess.CompletedProcess(
        ["lowcomm", *args], code, out.getvalue() + written[0], err.getvalue() + written[1]
    )


def lowcomm(
    *args: str, timeout: float = 240, cwd: Path | None = None, processes: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m lowcomm ARGS`` from this interpreter (in ``cwd``); output captured as
    text. A ``train`` run's workers are threads of one process (:func:`in_one_process`)
    unless ``processes``."""
    if not processes:
        args = in_one_process(args)
        if _runs_inline(args):
            return _inline(args, cwd)
    return subprocess.run(
        [sys.executable, "-m", "lowcomm", *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ}, cwd=cwd,
    )  # fmt: skip
