"""Your own model on your own dataset: the :class:`~lowcomm.train.task.Task` that
:func:`lowcomm.fit` builds from a model factory, a map-style dataset and a loss.

The training set is dealt to the workers as the corpus's token windows are
(:class:`~lowcomm.data.sampling.WorkerShard` over a :class:`~lowcomm.data.sampling.SampleIndex`):
IID (each epoch a permutation of ``(seed, epoch)``, worker ``w`` taking every W-th sample) or
non-IID (the samples in the order of ``split_key``, cut into W contiguous blocks, so a worker
sees mostly one or two keys), the remainder dropped; a worker's whole future is its position,
which a checkpoint saves, and an elastic resume re-deals the current pass. The validation set
gives ``--eval-batches`` fixed batches of evenly spaced samples, split over the workers.

There are no tokens here: the run counts samples (summary.json says ``"unit": "samples"``), and
``--token-budget`` is refused.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lowcomm.config import ConfigError, TrainConfig
from lowcomm.data.config import DataError
from lowcomm.data.sampling import IndexArray, SampleIndex, WorkerShard
from lowcomm.train.task import (
    Batch,
    LossFn,
    TaskData,
    Unit,
    model_loss,
    qualified_name,
    save_state,
)

#: A map-style dataset: ``len(data)`` samples, ``data[i]`` the i-th (a torch ``Dataset``, a
#: Hugging Face ``datasets.Dataset``, a list).
MapData = Any

#: ``collate_fn(samples) -> batch``; default: torch's ``default_collate``.
CollateFn = Callable[[list[Any]], Batch]


class ModuleCopy:
    """A model factory that returns a fresh deep copy of ``module`` (``fit(model=module)``)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.__qualname__ = type(module).__qualname__
        self.__module__ = type(module).__module__

    def __call__(self) -> nn.Module:
        return copy.deepcopy(self.module)


def default_collate(samples: list[Any]) -> Batch:
    from torch.utils.data import default_collate as collate

    return collate(samples)


def sample_order(data: MapData, split_key: Callable[[Any], Hashable] | None) -> IndexArray:
    """The order the shards number the samples in: the dataset's, or (non-IID by a key)
    sorted by ``split_key(sample)``, ties in dataset order."""
    count = len(data)
    if split_key is None:
        return np.arange(count, dtype=np.int64)
    keys = [_sortable(split_key(data[index])) for index in range(count)]
    return np.array(sorted(range(count), key=keys.__getitem__), dtype=np.int64)


def _sortable(key: Any) -> Any:
    if isinstance(key, torch.Tensor):
        return key.item() if key.numel() == 1 else tuple(key.flatten().tolist())
    return key


class DatasetShard:
    """One worker's (one rank's) resumable stream of micro-batches from a map-style dataset."""

    def __init__(
        self, data: MapData, order: IndexArray, collate: CollateFn, shard: WorkerShard
    ) -> None:
        self.data, self.order, self.collate, self.shard = data, order, collate, shard

    def next_batch(self) -> Batch:
        chosen = self.shard.next_indices()
        return self.collate([self.data[int(self.order[index])] for index in chosen.tolist()])

    def state_dict(self) -> dict[str, Any]:
        return self.shard.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shard.load_state_dict(state)


def first_tensor(batch: Batch) -> torch.Tensor | None:
    """The first tensor in a batch (depth first), or None."""
    if isinstance(batch, torch.Tensor):
        return batch
    items = batch.values() if isinstance(batch, dict) else batch
    if isinstance(items, Sequence | type({}.values())) and not isinstance(items, str | bytes):
        for item in items:
            found = first_tensor(item)
            if found is not None:
                return found
    return None


@dataclass
class DatasetTask:
    """A model factory trained on a map-style dataset with ``loss_fn(model, batch)``."""

    model_factory: Callable[[], nn.Module]
    train_data: MapData
    val_data: MapData | None = None
    loss_fn: LossFn | None = None
    collate_fn: CollateFn | None = None
    split_key: Callable[[Any], Hashable] | None = None
    unit: Unit = "samples"
    reads_corpus: bool = False

    def _collate(self) -> CollateFn:
        return self.collate_fn or default_collate

    def prepare(self, config: TrainConfig, report: Callable[[str], None] | None) -> None:
        try:
            self._shard(config, 0, 0)
        except (ValueError, DataError) as error:
            raise ConfigError(f"fit(train_data=), batch_size, workers: {error}") from None
        if report is not None:
            validation = "none" if self.val_data is None else f"{len(self.val_data):,}"
            report(
                f"dataset: {len(self.train_data):,} training samples, validation {validation}; "
                f"split {config.data.split}"
            )

    def check(self, config: TrainConfig) -> None:
        refusals = (
            (
                config.run.token_budget is not None,
                f"token_budget: {config.run.token_budget} counts "
                "tokens, and a dataset run counts samples; pass steps= instead",
            ),
            (
                config.run.init_from is not None,
                f"init_from: {config.run.init_from!r} loads a lowcomm "
                "language model; load your weights in the model factory instead",
            ),
            (
                config.placement.worker_sharding != "replicate",
                f"worker_sharding: "
                f"{config.placement.worker_sharding!r} shards the built-in GPT only; pass 'replicate'",
            ),
        )
        for refused, message in refusals:
            if refused:
                raise ConfigError(f"fit: {message}")

    def model(self, config: TrainConfig) -> nn.Module:
        return self.model_factory()

    def shapes_model(self, config: TrainConfig) -> nn.Module:
        from lowcomm.models.deferred import ShapesOnly

        try:
            with ShapesOnly():
                return self.model_factory()
        except Exception:  # a factory that reads files or numbers: build it for real
            return self.model_factory()

    def _shard(self, config: TrainConfig, worker: int, replica: int) -> DatasetShard:
        order = sample_order(self.train_data, self.split_key)
        shard = WorkerShard(
            SampleIndex(len(order)), rank=worker, world_size=config.placement.workers, seq_len=1,
            micro_batch_size=config.data.micro_batch_size, seed=config.run.seed,
            split=config.data.split, replica=replica, replicas=config.placement.ranks_per_worker,
        )  # fmt: skip
        return DatasetShard(self.train_data, order, self._collate(), shard)

    def data(self, config: TrainConfig, rank: int, everyone: list[Batch] | None = None) -> TaskData:
        worker, replica = divmod(rank, config.placement.ranks_per_worker)
        shard = self._shard(config, worker, replica)
        batches = self._validation_indices(config)
        batch = config.data.micro_batch_size
        mine = []
        for indices in batches[worker :: config.placement.workers]:
            assert self.val_data is not None  # (no indices without it)
            rows = indices[replica * batch : (replica + 1) * batch]
            if len(rows) > 0:
                mine.append(self._collate()([self.val_data[int(i)] for i in rows]))
        return TaskData(shard, mine, len(batches))

    def _validation_indices(self, config: TrainConfig) -> list[IndexArray]:
        """The validation batches' sample indices: ``--eval-batches`` batches of a worker's
        micro-batch (all its ranks), evenly spaced over the validation set."""
        if self.val_data is None or len(self.val_data) == 0:
            return []
        batch = config.data.micro_batch_size * config.placement.ranks_per_worker
        count = len(self.val_data)
        wanted = min(batch * config.run.eval_batches, count)
        if wanted >= batch:
            wanted -= wanted % batch
        chosen = np.rint(np.linspace(0, count - 1, wanted)).astype(np.int64)
        return [chosen[begin : begin + batch] for begin in range(0, wanted, batch)]

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return (self.loss_fn or model_loss)(model, batch)

    def count(self, batch: Batch) -> tuple[int, int]:
        tensor = first_tensor(batch)
        samples = 1 if tensor is None or tensor.dim() == 0 else int(tensor.shape[0])
        return samples, samples

    def calibration_batch(self, config: TrainConfig) -> Batch:
        size = min(config.data.micro_batch_size, len(self.train_data))
        return self._collate()([self.train_data[index] for index in range(size)])

    def export(self, model: nn.Module, directory: Path, config: TrainConfig) -> None:
        save_state(model, directory)

    def describe(self) -> dict[str, Any]:
        return {
            "model": qualified_name(self.model_factory),
            "data": f"{type(self.train_data).__name__} of {len(self.train_data)} samples",
            "unit": self.unit,
        }


class BatchStreamShard:
    """One worker's micro-batches from a re-iterable stream of batches (a DataLoader, an
    IterableDataset of batches, a list): worker ``w`` of ``W`` takes the batches numbered
    ``w, w + W, ...`` of each pass, the passes one after another (the last ``len % W`` of a
    pass are dropped, as a dataset's remainder is). Resume replays the stream up to the saved
    position, so it is exact when every pass yields the same batches."""

    def __init__(self, batches: Iterable[Batch], rank: int, workers: int) -> None:
        self.batches, self.rank, self.workers = batches, rank, workers
        self.position = 0
        self._stream: Iterator[Batch] | None = None
        self._taken = 0  # (this worker's batches taken from the current pass)

    def next_batch(self) -> Batch:
        for _ in range(2):
            if self._stream is None:
                self._stream, self._taken = iter(self.batches), 0
            group = list(itertools.islice(self._stream, self.workers))
            if len(group) == self.workers:
                self.position += 1
                self._taken += 1
                return group[self.rank]
            if self._taken == 0:
                break  # (a pass without a batch for every worker)
            self._stream = None  # the pass ended: start the next
        raise DataError(
            f"train_data: a pass over the batches gave fewer than {self.workers} (one per "
            f"worker); pass more batches, fewer workers, or a re-iterable (a list or a "
            f"DataLoader, not a generator)"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "rank": self.rank, "world_size": self.workers}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["world_size"]) != self.workers:
            raise ValueError(
                f"data state: a stream of batches dealt to {state['world_size']} workers "
                f"cannot be re-dealt to {self.workers}; resume with the same workers, or pass a "
                f"map-style dataset (elastic resume re-deals those)"
            )
        self._stream, self.position = None, 0
        for _ in range(int(state["position"])):
            self.next_batch()


@dataclass
class BatchStreamTask(DatasetTask):
    """A model factory trained on an iterable of batches (validation: the first
    ``--eval-batches`` batches of ``val_data``, also an iterable of batches)."""

    def __post_init__(self) -> None:
        if iter(self.train_data) is self.train_data:
            raise ConfigError(
                "fit: train_data is an iterator (one pass only); pass a re-iterable: a "
                "DataLoader, an IterableDataset, or an iterable whose iter() starts afresh"
            )

    def prepare(self, config: TrainConfig, report: Callable[[str], None] | None) -> None:
        if report is not None:
            report(f"data: a stream of batches ({type(self.train_data).__name__}), dealt in turn")

    def check(self, config: TrainConfig) -> None:
        super().check(config)
        if config.placement.ranks_per_worker > 1:
            raise ConfigError(
                f"fit: ranks_per_worker {config.placement.ranks_per_worker} with a stream of batches "
                f"(whose rows lowcomm cannot split); pass a map-style dataset, or 1"
            )

    def data(self, config: TrainConfig, rank: int, everyone: list[Batch] | None = None) -> TaskData:
        shard = BatchStreamShard(self.train_data, rank, config.placement.workers)
        if self.val_data is None:
            return TaskData(shard, [], 0)
        batches = list(itertools.islice(iter(self.val_data), config.run.eval_batches))
        return TaskData(shard, batches[rank :: config.placement.workers], len(batches))

    def calibration_batch(self, config: TrainConfig) -> Batch:
        return next(iter(self.train_data))

    def describe(self) -> dict[str, Any]:
        return {
            "model": qualified_name(self.model_factory),
            "data": f"batches from a {type(self.train_data).__name__}",
            "unit": self.unit,
        }
