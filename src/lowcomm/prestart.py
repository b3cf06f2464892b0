"""Start the worker forkserver before this process imports torch (kept free of torch).

``lowcomm train`` forks its workers from a server process that has imported torch and the
training loop once (:mod:`lowcomm.launch.spawn`). Started first thing, the server's imports
run while this process does its own (about a second each on a CPU core) and validates the
options, instead of after.
"""

from __future__ import annotations

import multiprocessing
import os

#: What the server imports once for every worker it forks.
WORKER_MODULES = [
    "torch",
    "torch.distributed",
    "lowcomm.launch.spawn",
    "lowcomm.train.loop",
]


def under_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (or another env:// launcher)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


def use_forkserver(modules: list[str]) -> bool:
    """Make ``modules`` the forkserver's imports (for a server not started yet); False where
    there is no forkserver (not POSIX)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    multiprocessing.set_forkserver_preload(modules)
    return True


def start_forkserver() -> None:
    """Start the forkserver now, in the background (a no-op if it runs, under torchrun, or
    without a forkserver): its imports overlap this process's."""
    if under_torchrun() or not use_forkserver(WORKER_MODULES):
        return
    from multiprocessing import forkserver

    forkserver.ensure_running()  # type: ignore[attr-defined]
