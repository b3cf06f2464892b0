"""The key prefix under which the workers of one torchrun rendezvous meet in the agent's store.

torchrun's agents share one TCP store across rendezvous rounds, so the keys a dead group wrote
(its Gloo and NCCL addresses) are still there when the next group starts. Each group must
therefore meet under a prefix no earlier group used, and every member of the group must pick
the same one. ``TORCHELASTIC_RESTART_COUNT`` is not such a prefix: an agent whose own worker
failed counts a restart, one that re-joined on a membership change does not, so the members of
one new group can hold different counts and wait on each other's keys until the store times
out, or read a dead group's addresses.

:func:`agree_generation` makes the prefix from the store alone: rank 0 of the new group draws
a generation number no earlier rank 0 drew (an atomic counter), and hands it to each other rank
in answer to a nonce that rank drew for this start, so no rank can take a dead group's answer
for its own.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

#: The store keys of the agreement (under the agent's store, beside the groups' prefixes).
GENERATION_KEY = "lowcomm/generation"

#: Seconds between polls of the store while waiting, and between a rank's re-announcements.
_POLL_S = 0.05
_REANNOUNCE_S = 1.0


class RendezvousTimeout(RuntimeError):
    """A rank of the new group did not take part in the agreement in time."""


def _hello(rank: int) -> str:
    return f"lowcomm/hello/{rank}"


def _answer(rank: int) -> str:
    return f"lowcomm/answer/{rank}"


def agree_generation(store: Any, rank: int, world_size: int, timeout_s: float) -> int:
    """The generation number every rank of this group returns, new to the store.

    Rank 0 takes the next value of :data:`GENERATION_KEY`, clears every rank's announcement
    (the ones left there are a dead group's: its workers all stopped before this rendezvous),
    then answers each announcement that appears with ``"<nonce> <generation>"``. Every other
    rank announces a fresh nonce, again every second (rank 0 may clear one written before it
    started), until the answer to its own nonce appears.

    Args:
        store: the agent's store (a ``torch.distributed.Store``: ``add``, ``set``, ``get``,
            ``check``, ``delete_key``).
        rank, world_size: this process's place in the new group.
        timeout_s: how long to wait for the other ranks (or rank 0) before giving up.

    Raises:
        RendezvousTimeout: naming the ranks that never took part.
    """
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        generation = int(store.add(GENERATION_KEY, 1))
        for other in range(1, world_size):
            store.delete_key(_hello(other))
        waiting = set(range(1, world_size))
        while waiting:
            for other in sorted(waiting):
                if store.check([_hello(other)]):
                    nonce = bytes(store.get(_hello(other))).decode()
                    store.set(_answer(other), f"{nonce} {generation}")
                    waiting.discard(other)
            if waiting and time.monotonic() > deadline:
                raise RendezvousTimeout(
                    f"rank 0: ranks {', '.join(map(str, sorted(waiting)))} of this rendezvous "
                    f"did not announce themselves within {timeout_s:.0f} s "
                    f"(--collective-timeout-s); check that their processes started"
                )
            time.sleep(_POLL_S)
        return generation
    nonce = uuid.uuid4().hex
    while True:
        store.set(_hello(rank), nonce)
        until = time.monotonic() + _REANNOUNCE_S
        while time.monotonic() < until:
            if store.check([_answer(rank)]):
                answered, _, given = bytes(store.get(_answer(rank))).decode().partition(" ")
                if answered == nonce:
                    return int(given)
            time.sleep(_POLL_S)
        if time.monotonic() > deadline:
            raise RendezvousTimeout(
                f"rank {rank}: rank 0 of this rendezvous did not answer within "
                f"{timeout_s:.0f} s (--collective-timeout-s); check that its process started"
            )


__all__ = ["GENERATION_KEY", "RendezvousTimeout", "agree_generation"]
