"""Deterministic, resumable sampling of training micro-batches and a fixed validation set.

Training windows are non-overlapping runs of ``seq_len + 1`` tokens inside each source's
training split; a window yields ``x = window[:-1]`` and ``y = window[1:]``. The order in
which a worker visits windows is a pure function of ``(seed, epoch, rank)``, so a worker's
whole future is determined by one integer (micro-batches consumed), which is all a checkpoint
needs to store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import torch
from numpy.random import default_rng
from torch import Tensor

from lowcomm.data.config import SPLITS, DataError
from lowcomm.data.corpus import PreparedCorpus, TokenArray

IndexArray = npt.NDArray[np.int64]


class _Windows:
    """Whole windows of ``window`` tokens in each stream, numbered by source then position,
    located arithmetically: no per-window array, and the streams (views of a memory-mapped
    token file) are read only where a drawn window lies."""

    def __init__(self, streams: list[TokenArray], window: int) -> None:
        self.streams = streams
        self.window = window
        counts = np.array([len(stream) // window for stream in streams], dtype=np.int64)
        self.first: IndexArray = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(counts)])
        self.count = int(self.first[-1])

    def locate(self, indices: IndexArray) -> tuple[IndexArray, IndexArray]:
        """``(source, start within that source)`` of each window index."""
        sources = np.searchsorted(self.first, indices, side="right").astype(np.int64) - 1
        return sources, (indices - self.first[sources]) * self.window

    def gather(self, indices: IndexArray) -> tuple[Tensor, Tensor]:
        sources, starts = self.locate(np.asarray(indices, dtype=np.int64))
        return _gather(self.streams, sources, starts, self.window)


def _gather(
    streams: list[TokenArray], sources: IndexArray, starts: IndexArray, window: int
) -> tuple[Tensor, Tensor]:
    rows = [
        np.asarray(streams[source][start : start + window])
        for source, start in zip(sources.tolist(), starts.tolist(), strict=True)
    ]
    tokens = torch.from_numpy(np.stack(rows).astype(np.int64))  # (B, T+1)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # (B, T), (B, T)


def _check_shard_arguments(
    rank: int,
    world_size: int,
    seq_len: int,
    micro_batch_size: int,
    seed: int,
    split: str,
    replica: int,
    replicas: int,
) -> None:
    """Raise ValueError for a :class:`WorkerShard` argument out of range."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"rank {rank} / world_size {world_size}: need world_size >= 1 and "
            f"0 <= rank < world_size"
        )
    if seq_len < 1:
        raise ValueError(f"seq_len: {seq_len} is not positive; pass a length such as 128")
    if micro_batch_size < 1:
        raise ValueError(f"--micro-batch-size: {micro_batch_size} is not positive; pass such as 8")
    if replicas < 1 or not 0 <= replica < replicas:
        raise ValueError(
            f"replica {replica} / replicas {replicas}: need replicas >= 1 and "
            f"0 <= replica < replicas"
        )
    if seed < 0:
        # numpy's SeedSequence only accepts non-negative entropy.
        raise ValueError(f"seed: {seed} is negative; pass a seed >= 0")
    if split not in SPLITS:
        raise ValueError(f"--split: unknown split {split!r}; choose one of {SPLITS}")


@dataclass(frozen=True)
class SampleIndex:
    """``count`` samples numbered ``0 .. count - 1`` (a map-style dataset's), for a
    :class:`WorkerShard` that deals out sample indices (:meth:`WorkerShard.next_indices`)
    instead of token windows: the same IID and non-IID orders, positions and resume."""

    count: int


class WorkerShard:
    """One worker's deterministic stream of training micro-batches.

    IID: each epoch, all windows are permuted with ``(seed, epoch)`` and worker ``rank`` takes
    every ``world_size``-th one. Non-IID: windows ordered by (source, position) are cut into
    ``world_size`` contiguous equal blocks, so a worker sees mostly one or two sources; each
    worker reshuffles its own block every epoch with ``(seed, epoch, rank)``. In both modes the
    remainder is dropped so every worker has the same number of windows and micro-batches.

    Args:
        corpus: The prepared corpus (only its training split is used).
        rank: This worker's index in ``[0, world_size)``.
        world_size: Number of workers sharing the data.
        seq_len: Tokens per input sequence.
        micro_batch_size: Sequences per micro-batch.
        seed: Seed shared by all workers of a run (>= 0).
        split: ``"iid"`` or ``"non-iid"``.
        replica: With a worker made of ``replicas`` ranks (``--ranks-per-worker``), this
            rank's index: the worker's micro-batch is ``replicas x micro_batch_size`` windows
            and this rank takes rows ``[replica * micro_batch_size, (replica + 1) *
            micro_batch_size)`` of it, so the ranks together see exactly the micro-batches of
            a one-rank worker with ``replicas`` times the micro-batch size.
        replicas: Ranks per worker (1: a plain worker).

    Raises:
        ValueError: If rank, world size, sequence length or split are invalid.
        DataError: If the corpus is too small for one micro-batch per worker.
    """

    def __init__(
        self,
        corpus: PreparedCorpus | SampleIndex,
        rank: int,
        world_size: int,
        seq_len: int,
        micro_batch_size: int,
        seed: int,
        split: str = "iid",
        replica: int = 0,
        replicas: int = 1,
    ) -> None:
        _check_shard_arguments(
            rank, world_size, seq_len, micro_batch_size, seed, split, replica, replicas
        )
        self.rank = rank
        self.world_size = world_size
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.split = split
        self.replica = replica
        self.replicas = replicas
        self._window = seq_len + 1
        self._windows: _Windows | None = None
        if isinstance(corpus, SampleIndex):
            self.num_windows = corpus.count
        else:
            self._windows = _Windows(corpus.train_tokens, self._window)
            self.num_windows = self._windows.count
        self.windows_per_worker = self.num_windows // world_size
        self.batches_per_epoch = self.windows_per_worker // (micro_batch_size * replicas)
        if self.batches_per_epoch == 0 and isinstance(corpus, SampleIndex):
            raise DataError(
                f"the training data has {self.num_windows} samples, but {world_size} worker(s) "
                f"x micro_batch_size {micro_batch_size} x {replicas} rank(s) need at least "
                f"{world_size * micro_batch_size * replicas}; reduce the batch size or the "
                f"number of workers, or pass more data"
            )
        if self.batches_per_epoch == 0:
            raise DataError(
                f"the training split has {self.num_windows} windows of seq_len+1="
                f"{self._window} tokens, but {world_size} worker(s) x micro_batch_size "
                f"{micro_batch_size} x {replicas} rank(s) need at least "
                f"{world_size * micro_batch_size * replicas}; reduce the "
                f"sequence length, the micro-batch size or the number of workers, or pass more "
                f"text with --data"
            )
        self.position = 0
        self._epoch_cached: int | None = None
        self._epoch_order: IndexArray = np.zeros(0, dtype=np.int64)
        self.carry: Carry | None = None
        """After a resume on another worker count: the pass it continues (see :class:`Carry`)."""

    @property
    def epoch(self) -> int:
        """Epoch of the next micro-batch (how many times this shard has been exhausted)."""
        return self._locate(self.position)[0]

    def _carry_batches(self) -> int:
        """Micro-batches of the carried-over pass (0 without one)."""
        if self.carry is None:
            return 0
        remaining = self.num_windows - len(self.carry.consumed)
        return (remaining // self.world_size) // (self.micro_batch_size * self.replicas)

    def _locate(self, position: int) -> tuple[int, int, bool]:
        """(epoch, micro-batch within it, whether it is the carried-over pass) of ``position``."""
        carried = self._carry_batches()
        if self.carry is not None and position < carried:
            return self.carry.epoch, position, True
        first = 0 if self.carry is None else self.carry.epoch + 1
        epoch, batch = divmod(position - carried, self.batches_per_epoch)
        return first + epoch, batch, False

    def _carried_order(self) -> IndexArray:
        """This worker's windows of the carried-over pass: the pass's permutation without the
        positions the old workers consumed, dealt round-robin over the new workers."""
        assert self.carry is not None
        permutation = default_rng([self.seed, self.carry.epoch]).permutation(self.num_windows)
        left = np.setdiff1d(np.arange(self.num_windows, dtype=np.int64), self.carry.consumed)
        return permutation[left[self.rank :: self.world_size]].astype(np.int64)

    def _window_indices_for_epoch(self, epoch: int) -> IndexArray:
        """This worker's window indices, in visiting order, for one epoch."""
        used = self.windows_per_worker * self.world_size
        if self.split == "iid":
            # Every worker computes the same global permutation, so shards are disjoint.
            generator = default_rng([self.seed, epoch])
            permutation = generator.permutation(self.num_windows)[:used]
            return permutation[self.rank :: self.world_size].astype(np.int64)
        begin = self.rank * self.windows_per_worker
        block = np.arange(begin, begin + self.windows_per_worker, dtype=np.int64)
        generator = default_rng([self.seed, epoch, self.rank])
        return generator.permutation(block).astype(np.int64)

    def window_indices(self, epoch: int = 0) -> IndexArray:
        """Indices of the windows this worker visits in ``epoch``, in order (for inspection).

        Args:
            epoch: The epoch.

        Returns:
            Window indices; only the first ``batches_per_epoch * micro_batch_size`` are used.
        """
        return self._window_indices_for_epoch(epoch)

    def window_sources(self, indices: IndexArray) -> IndexArray:
        """Source index of each given window.

        Args:
            indices: Window indices as returned by :meth:`window_indices`.

        Returns:
            The source index (into ``corpus.source_names``) of each window.
        """
        return self._token_windows().locate(np.asarray(indices, dtype=np.int64))[0]

    def window_token_ranges(self, indices: IndexArray) -> list[tuple[int, int, int]]:
        """Token ranges covered by windows, as ``(source, start, stop)`` within that source.

        Args:
            indices: Window indices.

        Returns:
            One half-open range per window, in the source's training token stream.
        """
        sources, starts = self._token_windows().locate(np.asarray(indices, dtype=np.int64))
        return [
            (source, start, start + self._window)
            for source, start in zip(sources.tolist(), starts.tolist(), strict=True)
        ]

    def next_batch(self) -> tuple[Tensor, Tensor]:
        """Return the next micro-batch and advance the position.

        Returns:
            ``(x, y)``, both int64 of shape ``(micro_batch_size, seq_len)``, with
            ``y[:, t] == x[:, t + 1]`` for ``t < seq_len - 1``.
        """
        return self._token_windows().gather(self.next_indices())

    def _token_windows(self) -> _Windows:
        if self._windows is None:
            raise TypeError("WorkerShard: a shard over a SampleIndex yields next_indices()")
        return self._windows

    def next_indices(self) -> IndexArray:
        """The window (or sample) indices of the next micro-batch; advances the position."""
        epoch, batch_in_epoch, carried = self._locate(self.position)
        key = -1 - epoch if carried else epoch
        if self._epoch_cached != key:
            self._epoch_order = (
                self._carried_order() if carried else self._window_indices_for_epoch(epoch)
            )
            self._epoch_cached = key
        begin = (batch_in_epoch * self.replicas + self.replica) * self.micro_batch_size
        chosen = self._epoch_order[begin : begin + self.micro_batch_size]
        self.position += 1
        return chosen

    def state_dict(self) -> dict[str, Any]:
        """Return what is needed to resume exactly.

        Returns:
            The position (micro-batches consumed) plus the settings it is valid for (and,
            after a resume on another worker count, the carried-over pass).
        """
        carry = {} if self.carry is None else self.carry.state()
        return {
            **carry,
            "position": self.position,
            "seed": self.seed,
            "rank": self.rank,
            "world_size": self.world_size,
            "seq_len": self.seq_len,
            "micro_batch_size": self.micro_batch_size,
            "num_windows": self.num_windows,
            "replica": self.replica,
            "replicas": self.replicas,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` output.

        Args:
            state: A state produced by a shard with the same settings and corpus.

        Raises:
            ValueError: If the state was produced with different settings, so that resuming
                would silently yield different data.
        """
        mine = self.state_dict()
        mismatched = [
            f"{name}={state[name]} (this shard has {mine[name]})"
            for name in mine
            if name not in ("position", *Carry.KEYS)
            and name in state
            and int(state[name]) != mine[name]
        ]
        if mismatched:
            raise ValueError(
                "data state: cannot resume a shard built with different settings: "
                + ", ".join(mismatched)
                + "; resume with the same seed, world size, sequence length, micro-batch size "
                "and data"
            )
        position = int(state["position"])
        if position < 0:
            raise ValueError(f"data state: position {position} is negative")
        self.position = position
        self.carry = Carry.from_state(state)
        self._epoch_cached = None


@dataclass(frozen=True)
class Carry:
    """The pass a shard continues after a resume on another number of workers (IID only).

    The old workers consumed ``consumed``: positions in pass ``epoch``'s permutation of all
    windows. The new workers deal the rest of that permutation round-robin among themselves
    (the remainder that does not fill a micro-batch on every worker is dropped, as at every
    epoch's end), then go on with epoch ``epoch + 1`` as usual. So no window of the current
    pass is repeated or skipped.
    """

    KEYS: ClassVar[tuple[str, str]] = ("carry_epoch", "carry_consumed")
    epoch: int
    consumed: IndexArray

    def state(self) -> dict[str, Any]:
        return {
            "carry_epoch": self.epoch,
            "carry_consumed": torch.from_numpy(self.consumed.astype(np.int64)),
        }

    @staticmethod
    def from_state(state: dict[str, Any]) -> Carry | None:
        if "carry_epoch" not in state:
            return None
        consumed = state["carry_consumed"]
        array = consumed.cpu().numpy() if isinstance(consumed, Tensor) else np.asarray(consumed)
        return Carry(int(state["carry_epoch"]), np.sort(array.astype(np.int64)))


def consumed_in_pass(states: list[dict[str, Any]]) -> Carry:
    """What a group of shards (the per-rank data states of one checkpoint, every worker's
    ranks included) consumed of their current pass, as a :class:`Carry` for new shards.

    Raises:
        DataError: the shards are not in the same pass.
    """
    first = states[0]
    workers, replicas = int(first["world_size"]), int(first["replicas"])
    per_batch = int(first["micro_batch_size"]) * replicas
    located: dict[int, tuple[int, int, Carry | None]] = {}
    for state in states:
        shard_carry = Carry.from_state(state)
        position = int(state["position"])
        carried = 0
        if shard_carry is not None:
            unused = int(first["num_windows"]) - len(shard_carry.consumed)
            carried = (unused // workers) // per_batch
        if shard_carry is not None and position < carried:
            located[int(state["rank"])] = (shard_carry.epoch, position, shard_carry)
        else:
            base = 0 if shard_carry is None else shard_carry.epoch + 1
            per_epoch = (int(first["num_windows"]) // workers) // per_batch
            epoch, batch = divmod(position - carried, per_epoch)
            located[int(state["rank"])] = (base + epoch, batch, None)
    epochs = {epoch for epoch, _, _ in located.values()}
    if len(epochs) != 1:
        raise DataError(f"the workers are in different passes over the data ({sorted(epochs)})")
    epoch = epochs.pop()
    taken: list[IndexArray] = []
    for rank, (_, batch, carry) in sorted(located.items()):
        mine = np.arange(batch * per_batch, dtype=np.int64)
        if carry is None:
            taken.append(rank + workers * mine)
        else:
            left = np.setdiff1d(
                np.arange(int(first["num_windows"]), dtype=np.int64), carry.consumed
            )
            taken.extend([carry.consumed, left[rank::workers][mine]])
    return Carry(epoch, np.unique(np.concatenate(taken)))


def validation_batches(
    corpus: PreparedCorpus, seq_len: int, batch_size: int, num_batches: int
) -> list[tuple[Tensor, Tensor]]:
    """Build a fixed validation set spread evenly over every source's held-out split.

    Windows are non-overlapping runs of ``seq_len + 1`` tokens inside the validation splits.
    Sources share the requested windows as equally as their sizes allow, and within a source
    the chosen windows are evenly spaced. No randomness is involved.

    Args:
        corpus: The prepared corpus.
        seq_len: Tokens per input sequence.
        batch_size: Sequences per batch.
        num_batches: Batches wanted; fewer are returned if the validation split is too small
            (a single smaller batch if it cannot fill one).

    Returns:
        A list of ``(x, y)`` int64 pairs of shape ``(batch, seq_len)``.

    Raises:
        ValueError: If a size argument is not positive.
        DataError: If no validation window of ``seq_len + 1`` tokens exists.
    """
    if seq_len < 1 or batch_size < 1 or num_batches < 1:
        raise ValueError(
            f"validation_batches: seq_len={seq_len}, batch_size={batch_size} and "
            f"num_batches={num_batches} must all be positive"
        )
    window = seq_len + 1
    available = [len(stream) // window for stream in corpus.val_tokens]
    total_available = sum(available)
    if total_available == 0:
        raise DataError(
            f"the validation split has no window of seq_len+1={window} tokens "
            f"(largest source holds {max((len(s) for s in corpus.val_tokens), default=0)}); "
            f"raise --val-fraction, shorten the sequence length, or pass more text"
        )
    wanted = min(batch_size * num_batches, total_available)
    if wanted >= batch_size:
        wanted -= wanted % batch_size
    chosen = _spread_windows(available, wanted, window)
    # Interleave sources so that any prefix of the batches is itself spread over sources.
    chosen.sort()
    sources = np.array([source for _, source, _ in chosen], dtype=np.int64)
    starts = np.array([start for _, _, start in chosen], dtype=np.int64)
    batches: list[tuple[Tensor, Tensor]] = []
    for begin in range(0, len(starts), batch_size):
        piece = slice(begin, begin + batch_size)
        batches.append(_gather(corpus.val_tokens, sources[piece], starts[piece], window))
    return batches


def _spread_windows(available: list[int], wanted: int, window: int) -> list[tuple[float, int, int]]:
    """``wanted`` windows shared over sources holding ``available`` windows each:
    (relative position in its source, source, start in it), evenly spaced in each source."""
    # Water-filling: hand out one window per source in turn, skipping exhausted sources.
    quota = [0] * len(available)
    remaining = wanted
    while remaining > 0:
        for source, capacity in enumerate(available):
            if remaining > 0 and quota[source] < capacity:
                quota[source] += 1
                remaining -= 1
    chosen: list[tuple[float, int, int]] = []
    for source, count in enumerate(quota):
        if count == 0:
            continue
        # linspace over whole-window indices; spacing >= 1 because count <= capacity, so the
        # rounded indices are distinct and the windows cannot overlap.
        window_indices = np.rint(np.linspace(0, available[source] - 1, count)).astype(np.int64)
        for rank_in_source, window_index in enumerate(window_indices.tolist()):
            relative = (rank_in_source + 0.5) / count
            chosen.append((relative, source, window * window_index))
    return chosen


def describe_shard(shard: WorkerShard) -> dict[str, Any]:
    """Summarise a shard for logging.

    Args:
        shard: The shard.

    Returns:
        Window and batch counts and the current epoch/position.
    """
    return {
        "split": shard.split,
        "num_windows": shard.num_windows,
        "windows_per_worker": shard.windows_per_worker,
        "batches_per_epoch": shard.batches_per_epoch,
        "epoch": shard.epoch,
        "position": shard.position,
    }
