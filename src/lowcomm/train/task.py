"""What a run trains: its model, its data and its loss, behind one small interface.

The training loop (:mod:`lowcomm.train.loop`) never builds a model or reads data itself: it asks
the run's :class:`Task` for the initial model, this process's data shard and validation
batches, the loss of a batch and what a batch counts (samples, and tokens where there are
tokens). :class:`CorpusTask` is what ``lowcomm train`` runs: the built-in GPT (or a
``transformers`` model, or ``--init-from``) on the prepared corpus (``--data``). Your own
model, dataset and loss come in through :func:`lowcomm.fit`, as a
:class:`lowcomm.train.user_task.DatasetTask` or a :class:`CorpusTask` with a model factory:
the same loop, the same machinery.

A task is built in the launching process and pickled to every worker, so it holds only what
pickles (functions and classes defined in importable modules, datasets); what it prepares
in a worker (the corpus) it keeps in a private attribute that is not pickled.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
from torch import nn

from lowcomm.config import TrainConfig

if TYPE_CHECKING:
    from lowcomm.data import PreparedCorpus

#: A batch as the data yields it: a tensor, or tuples, lists and dicts of them.
Batch = Any

#: ``loss_fn(model, batch) -> scalar tensor`` (the batch already on the model's device).
LossFn = Callable[[nn.Module, Batch], torch.Tensor]

#: What a run counts its data in: tokens (language models) or samples (anything else).
Unit = Literal["tokens", "samples"]


class Shard(Protocol):
    """One worker's deterministic, resumable stream of training micro-batches."""

    def next_batch(self) -> Batch: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class TaskData:
    """This process's data: its training shard and its slice of the validation batches."""

    shard: Shard
    validation: list[Batch]
    """This process's validation batches (on the CPU; the loop moves them)."""
    validation_batches: int
    """Validation batches of the whole run."""


class Task(Protocol):
    """What the training loop asks of a run's model and data (see the module docstring)."""

    unit: Unit
    reads_corpus: bool
    """Whether the task reads the corpus (``--data``): the launcher prepares (caches) and
    checks it before any worker starts."""

    def prepare(self, config: TrainConfig, report: Callable[[str], None] | None) -> None:
        """In the launcher, before any worker starts: prepare and check the task's own data.

        Raises:
            ConfigError: the data cannot serve the run, in one line naming the fix."""
        ...

    def check(self, config: TrainConfig) -> None:
        """Refuse options this task cannot honour (ConfigError, one line)."""
        ...

    def model(self, config: TrainConfig) -> nn.Module:
        """The initial model on the CPU (the loop seeds the global generator first, and
        broadcasts worker 0's parameters)."""
        ...

    def shapes_model(self, config: TrainConfig) -> nn.Module:
        """The model for checks that need its shapes only (on the meta device if it can be)."""
        ...

    def data(self, config: TrainConfig, rank: int, everyone: list[Batch] | None = None) -> TaskData:
        """This process's data; ``everyone``: the run's validation batches when the workers of
        one process share them (:func:`lowcomm.train.shared.shared_setup`)."""
        ...

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor: ...

    def count(self, batch: Batch) -> tuple[int, int]:
        """(samples, units) of a batch: units are tokens, or samples again."""
        ...

    def calibration_batch(self, config: TrainConfig) -> Batch:
        """A fixed batch of a micro-batch's shape, for the calibrated compute model."""
        ...

    def export(self, model: nn.Module, directory: Path, config: TrainConfig) -> None:
        """Save the deployed model into ``directory`` (the run's ``model/``)."""
        ...

    def describe(self) -> dict[str, Any]:
        """What summary.json says about the task."""
        ...


def to_device(batch: Batch, device: torch.device) -> Batch:
    """``batch`` with every tensor on ``device``; to a GPU from pinned memory, asynchronously
    (the host goes on queuing kernels)."""
    if isinstance(batch, torch.Tensor):
        if device.type != "cuda":
            return batch.to(device)
        return batch.pin_memory().to(device, non_blocking=True)
    if isinstance(batch, tuple | list):
        moved = [to_device(item, device) for item in batch]
        if hasattr(batch, "_fields"):  # a named tuple
            return type(batch)(*moved)
        return type(batch)(moved)
    if isinstance(batch, Mapping):
        return {key: to_device(value, device) for key, value in batch.items()}
    return batch


def model_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The loss of lowcomm's language models: ``model(inputs, targets)`` returns
    ``(logits, loss)`` (the built-in GPT and the ``transformers`` adapter do)."""
    inputs, targets = batch
    output = model(inputs, targets)
    loss = output[1] if isinstance(output, tuple) and len(output) == 2 else None
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"loss_fn: none given, and {type(model).__name__}(inputs, targets) did not return "
            f"(output, loss); pass loss_fn=lambda model, batch: ... (a function of the model "
            f"and a batch returning a scalar tensor)"
        )
    return loss


@dataclass
class CorpusTask:
    """A language model on the prepared corpus (``--data``): the built-in GPT, a
    ``transformers`` model or ``--init-from`` (``--model.*``) unless ``model_factory`` gives
    the model, trained on ``loss_fn`` (default: the model's own, see :func:`model_loss`).
    Batches are ``(inputs, targets)`` token tensors of shape (micro-batch, block size)."""

    model_factory: Callable[[], nn.Module] | None = None
    loss_fn: LossFn | None = None
    unit: Unit = "tokens"
    reads_corpus: bool = True

    def __post_init__(self) -> None:
        self._corpus: PreparedCorpus | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_corpus": None}  # (each worker maps its own)

    def corpus(self, config: TrainConfig) -> PreparedCorpus:
        """The prepared corpus (cached: the launcher prepared it, so a worker maps it)."""
        if self._corpus is None:
            from lowcomm.data import prepare_corpus

            self._corpus = prepare_corpus(config.data)
        return self._corpus

    def prepare(self, config: TrainConfig, report: Callable[[str], None] | None) -> None:
        return None  # (the launcher prepares the corpus: reads_corpus)

    def check(self, config: TrainConfig) -> None:
        return None

    def model(self, config: TrainConfig) -> nn.Module:
        if self.model_factory is not None:
            return self.model_factory()
        from lowcomm.models import build_model

        if config.run.init_from is None:
            return build_model(config.model, self.corpus(config).vocab_size)
        # --init-from: the saved weights, loaded straight into the model (pre-flight checked
        # that they fit); the architecture is the directory's config.json.
        from lowcomm.models.init_from import preflight_init_from

        return preflight_init_from(config.run.init_from, config.model).load()

    def shapes_model(self, config: TrainConfig) -> nn.Module:
        from lowcomm.models import build_model
        from lowcomm.models.deferred import ShapesOnly

        with ShapesOnly():
            if self.model_factory is not None:
                return self.model_factory()
            # A model described by a config.json has its own vocabulary size (checked
            # against the tokenizer's in pre-flight), so any size up to it does here.
            vocab_size = config.data.vocab_size if config.model.config is None else 1
            return build_model(config.model, vocab_size)

    def data(self, config: TrainConfig, rank: int, everyone: list[Batch] | None = None) -> TaskData:
        from lowcomm.data import WorkerShard

        corpus = self.corpus(config)
        ranks = config.placement.ranks_per_worker
        worker, replica = divmod(rank, ranks)
        workers = config.placement.workers
        batch = config.data.micro_batch_size
        shard = WorkerShard(
            corpus, rank=worker, world_size=workers, seq_len=config.model.block_size,
            micro_batch_size=batch, seed=config.run.seed, split=config.data.split,
            replica=replica, replicas=ranks,
        )  # fmt: skip
        # A worker evaluates the batches a flat worker would (R x the micro-batch size), each
        # of its ranks a slice of every batch.
        everyone = self.validation(config) if everyone is None else everyone
        rows = slice(replica * batch, (replica + 1) * batch)
        mine = [(x[rows], y[rows]) for x, y in everyone[worker::workers] if x[rows].shape[0] > 0]
        return TaskData(shard, mine, len(everyone))

    def validation(self, config: TrainConfig) -> list[Batch]:
        """The run's validation batches (of a worker's micro-batch: all its ranks)."""
        from lowcomm.data import validation_batches

        return validation_batches(  # type: ignore[return-value]
            self.corpus(config),
            seq_len=config.model.block_size,
            batch_size=config.data.micro_batch_size * config.placement.ranks_per_worker,
            num_batches=config.run.eval_batches,
        )

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return (self.loss_fn or model_loss)(model, batch)

    def count(self, batch: Batch) -> tuple[int, int]:
        inputs = batch[0]
        return inputs.shape[0], inputs.numel()

    def calibration_batch(self, config: TrainConfig) -> Batch:
        # A fixed random micro-batch of tokens (seed 0), so every language-model run's
        # calibration measures the same batch.
        generator = torch.Generator().manual_seed(0)
        shape = (config.data.micro_batch_size, config.model.block_size)
        vocab_size = self.corpus(config).vocab_size
        inputs = torch.randint(0, vocab_size, shape, generator=generator)
        targets = torch.randint(0, vocab_size, shape, generator=generator)
        return inputs, targets

    def export(self, model: nn.Module, directory: Path, config: TrainConfig) -> None:
        from lowcomm.models.base import CausalLM

        if self.model_factory is not None and not isinstance(model, CausalLM):
            save_state(model, directory)
            return
        from lowcomm.models.export import save_model

        corpus = self.corpus(config)
        save_model(
            model, directory, corpus.tokenizer_path, corpus.end_of_text,
            tokenizer_source=config.data.tokenizer,
        )  # fmt: skip

    def describe(self) -> dict[str, Any]:
        model = (
            "lowcomm (--model.*)"
            if self.model_factory is None
            else qualified_name(self.model_factory)
        )
        return {"model": model, "data": "corpus (--data)", "unit": self.unit}


def qualified_name(thing: object) -> str:
    """``module.qualified_name`` of a function or class (or of an object's class)."""
    named = isinstance(thing, type) or (callable(thing) and hasattr(thing, "__qualname__"))
    kind = thing if named else type(thing)
    return f"{getattr(kind, '__module__', '?')}.{getattr(kind, '__qualname__', repr(kind))}"


def save_state(model: nn.Module, directory: Path) -> None:
    """Write ``model``'s state dict to ``directory/state_dict.pt`` (atomically)."""
    directory.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=".state_dict.pt.tmp")
    os.close(handle)
    try:
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, temporary)
        os.replace(temporary, directory / "state_dict.pt")
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def calibration_pass(
    task: Task, config: TrainConfig, device: torch.device
) -> Callable[[nn.Module], torch.Tensor]:
    """The calibrated compute model's timed pass: the task's loss on a fixed micro-batch."""
    batch: list[Batch] = []

    def loss(model: nn.Module) -> torch.Tensor:
        if not batch:  # (built when the calibration runs: most runs read one)
            batch.append(to_device(task.calibration_batch(config), device))
        return task.loss(model, batch[0])

    return loss
