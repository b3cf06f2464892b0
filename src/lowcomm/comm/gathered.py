"""One decode of an all-gather for all the workers of one process that received it.

After an all-gather every worker holds the same bytes, and a method that all-gathers compressed
payloads (DeMo, SparseLoCo) then has each worker decode all of them into the same mean. Workers
of their own processes must; K workers in one process would do the same work K times, K x M
decodes a step (at M = K = 256, most of DeMo's step). :func:`once_per_gather` lets the first
worker that asks compute the result and hands the others a copy of it, when that saves work and
changes nothing a run reports:

* **Same input.** The in-process all-gather, and the stacked one of K workers in each of P
  processes, mark the outputs they fill as one gather (:func:`mark_gathered`). A worker gets the shared result only for an output so marked and
  not written since (the tensor's version counter); any other tensor (a gather by
  ``torch.distributed``, a worker's own copy, a modified buffer) is computed as before.
* **Same result.** ``compute`` must be a deterministic function of the gathered bytes (it is
  for the decodes: a fixed sequence of CPU operations). Every worker gets the first result's
  bits in a tensor of its own.
* **Same charge.** On the calibrated clock a worker is charged by the elements its operations
  write: a worker handed the result is charged what computing it counted, and the copy counts
  nothing. A clock that charges the time compute takes (``--compute-model cpu-time``, the
  real clock) would charge the other workers less than their processes would pay: there every
  worker computes. On the GPU every worker computes too (sharing would need the workers'
  streams ordered on the result).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from lowcomm.comm.calibration import current_counter, uncounted
from lowcomm.comm.turns import holding

#: Clock compute models that charge by a count or a declaration, not by time taken.
COUNTED_MODELS = ("declared", "calibrated")


class _Gather:
    """One in-process all-gather: the results computed from it so far, by key."""

    def __init__(self, members: int) -> None:
        self.members = members
        self.lock = threading.Lock()
        self.results: dict[str, tuple[torch.Tensor, int]] = {}  # key -> (result, elements)
        self.readers: dict[str, int] = {}  # key -> how many members took the result


_marks: WeakIdKeyDictionary = WeakIdKeyDictionary()
_marks_lock = threading.Lock()


def mark_gathered(outputs: Sequence[torch.Tensor]) -> None:
    """``outputs``, just filled by one all-gather (the same bytes in each), are one gather."""
    gather = _Gather(len(outputs))
    with _marks_lock:
        for output in outputs:
            _marks[output] = (gather, output._version)


def _gather_of(tensor: torch.Tensor) -> _Gather | None:
    """The gather that filled ``tensor``, if nothing wrote to it since."""
    with _marks_lock:
        mark: tuple[_Gather, int] | None = _marks.get(tensor)  # type: ignore[no-untyped-call]
    if mark is None or mark[1] != tensor._version:
        return None
    return mark[0]


def once_per_gather(
    gathered: torch.Tensor,
    key: str,
    compute: Callable[[], torch.Tensor],
    *,
    compute_model: str | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``compute()``, a deterministic function of the all-gathered ``gathered``, as a tensor of
    this worker's own: computed by the first worker of the gather that asks for ``key``, a
    copy of it for the others (see the module docstring for when). ``compute_model``: how the
    worker's clock charges compute (``Clock.compute_model``; None: no clock). ``out``: the
    tensor ``compute`` writes into and returns, which a worker handed the result gets it in
    (None: ``compute`` returns a new tensor, and so does this)."""
    gather = _gather_of(gathered)
    if (
        gather is None
        or gather.members < 2
        or gathered.device.type != "cpu"
        or (compute_model is not None and compute_model not in COUNTED_MODELS)
    ):
        return compute()
    counter = current_counter()
    with holding(gather.lock):  # (the first computes; its peers give their turns away)
        found = gather.results.get(key)
        if found is None:
            before = 0 if counter is None else counter.elements
            own = compute()
            spent = 0 if counter is None else counter.elements - before
            with uncounted():
                gather.results[key] = (own.clone(), spent)
        else:
            shared, spent = found
            with uncounted():  # (the copy is not the worker's compute: what it stands for is)
                own = shared.clone() if out is None else out.copy_(shared)
            if counter is not None:
                counter.elements += spent
        gather.readers[key] = gather.readers.get(key, 0) + 1
        if gather.readers[key] == gather.members:  # (the last: nobody copies from it now)
            del gather.results[key]
    return own
