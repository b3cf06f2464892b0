"""A torchft worker's membership.json across a resume: the resumed worker continues the records
its stopped (or killed) process wrote, as its metrics.jsonl continues that process's lines.

membership.json is what torchft decided for the worker (its quorums, rounds committed or
dropped, healings and the parameters' digests, each at its loop step) and the counters they
add up to (rounds committed and dropped, the tokens its committed rounds kept). A resumed
worker restores its checkpoint of step S (S steps trained), so it keeps the earlier records of
the steps before S and drops those of step S on, which it trains again (a process killed after
its checkpoint trained them too, but its state of them is lost), exactly as
:class:`lowcomm.train.metrics.RunWriter` keeps metrics.jsonl's lines. It then says where it
resumed (a ``resumed`` event at step S) and goes on. Its rounds committed and dropped are
counted from the events it keeps; its tokens are the checkpoint's, kept beside it in
torchft.json (:func:`counters`), not the earlier record's, which a killed process had carried
past S.

The resumed job's startup round (its quorum and commit at step S) is recorded as every start's
is: a resumed record holds the straight run's events of every step, and this round besides.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lowcomm.atomic import atomic_write_text

if TYPE_CHECKING:
    from lowcomm.membership.torchft_comm import Replica

__all__ = [
    "counters",
    "part_committed_tokens",
    "record_name",
    "rounds",
    "take_back",
    "write_record",
]

#: torchft.json's key for the records' counters at its checkpoint (beside the Manager's state).
COUNTERS_KEY = "records"


def record_name(rank: int) -> str:
    """The file of a worker's rank ``rank`` in its run directory (rank 0: the worker's)."""
    return "membership.json" if rank == 0 else f"membership.rank{rank}.json"


def counters(replica: Replica) -> dict[str, dict[str, int]]:
    """What torchft.json keeps of the records at a checkpoint (:data:`COUNTERS_KEY`): the
    tokens the worker's committed rounds kept and those it trained since its last commit (a
    checkpoint inside a round holds them: the round's commit counts them after the resume)."""
    return {
        COUNTERS_KEY: {
            "committed_tokens": int(replica.committed_tokens),
            "pending_tokens": int(replica.pending_tokens),
        }
    }


def take_back(replica: Replica, directory: Path, step: int, kept: dict[str, Any]) -> None:
    """Continue the records of the run in ``directory`` (the worker's own, resumed at its
    checkpoint of ``step``; ``kept``: that checkpoint's torchft.json): the events and digests
    of the steps before ``step`` and the tokens the checkpoint kept; then a ``resumed`` event
    (written at once: the earlier record is never lost to a later write).

    The Replica's own round counters stay this process's (its first quorums assemble the
    resumed job, not a change of it); the record counts the rounds from the events
    (:func:`rounds`)."""
    earlier = _read(directory / record_name(replica.rank))
    events = [e for e in earlier.get("events") or [] if _before(e, step)]
    digests = [d for d in earlier.get("digests") or [] if _before(d, step)]
    replica.events[:0] = events
    replica.digests[:0] = digests
    tokens = kept.get(COUNTERS_KEY) or {}
    replica.committed_tokens = int(tokens.get("committed_tokens") or 0)
    replica.pending_tokens = int(tokens.get("pending_tokens") or 0)
    replica._log({
        "event": "resumed", "time": time.time(), "step": step,
        "checkpoint": str(directory), "committed_tokens": replica.committed_tokens,
    })  # fmt: skip


def rounds(events: list[dict[str, Any]], kind: str) -> int:
    """The rounds the worker's events say were ``kind`` (``commit`` or ``dropped``), the
    resumed worker's earlier ones included."""
    return sum(1 for event in events if event.get("event") == kind)


def _before(entry: dict[str, Any], step: int) -> bool:
    at = entry.get("step")
    return isinstance(at, int) and at < step


def _read(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return {}


def part_committed_tokens(record: dict[str, Any]) -> int:
    """The tokens a worker's record says its process committed itself: the whole run's, less
    those its last resume took back (a resumed job's goodput is its own part's)."""
    total = int(record.get("committed_tokens") or 0)
    resumes = [e for e in record.get("events") or [] if e.get("event") == "resumed"]
    return total - (int(resumes[-1].get("committed_tokens") or 0) if resumes else 0)


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Write a worker's membership.json atomically (:mod:`lowcomm.atomic`): a reader, or the
    resume of a process killed mid-write, sees the old record or the whole new one."""
    atomic_write_text(path, json.dumps(record, indent=1, default=_plain) + "\n")


def _plain(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)
