"""What the workers of one process share (``--workers-per-process K``): built once, read by all.

A worker process of its own prepares the corpus, seeds the process-global generator, builds the
initial model, cuts the validation batches and (on the calibrated clock) measures its compute
itself. K workers in one process do each of these once: the corpus, the tokenizer, the
validation batches and the calibration are shared read-only; the initial model is built once
and copied per worker; each worker's random stream is its own ``torch.Generator``, started at
the state the process-global generator has after building the model in a process of its own,
so both placements draw the same numbers.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from lowcomm.config import TrainConfig
from lowcomm.data import PreparedCorpus
from lowcomm.models import build_model
from lowcomm.strategies.flat import laid_out_copy
from lowcomm.train.task import Batch, CorpusTask, Task

Batches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class SharedSetup:
    """The read-only part of the workers of one process."""

    corpus: PreparedCorpus | None
    """The prepared corpus (None: the task reads none)."""
    model: torch.nn.Module
    """The initial model, on the run's device (each worker trains a copy)."""
    rng_state: torch.Tensor
    """The state every worker's generator starts from."""
    validation: list[Batch] | None
    """The run's validation batches (each worker evaluates its slice; None: each worker
    takes its own from the task)."""
    whole_run: bool = True
    """Every worker of the run is in this process (False: one of several processes of
    several workers, ``lowcomm.launch.stacked``)."""

    def copy_model(self, room: int = 1) -> torch.nn.Module:
        """A worker's own copy of the initial model: ``copy.deepcopy``, less its slowest part.

        A module holds about a dozen containers, empty but for a hook or a non-persistent
        buffer now and then (``_forward_hooks``, ``_state_dict_hooks``, ...); deepcopy copies
        each through ``__reduce_ex__``, whose slot-name lookup a built-in container cannot
        cache, and that was two thirds of the copy: about 60% of the set-up of 256 workers
        (sampled with py-spy). Empty ones of exactly those types are handed to deepcopy
        already copied (an empty container of the same type); everything else, aliasing
        included, is deepcopy's. The trainable parameters are copied end to end into one buffer
        (``room``: its length a multiple of it, the world size) that the worker's flat buffers
        then adopt (:func:`~lowcomm.strategies.flat.laid_out_copy`)."""
        memo: dict[int, object] = {}
        for module in self.model.modules():
            for value in vars(module).values():
                if type(value) in _EMPTY_COPIES and not value:
                    memo[id(value)] = type(value)()
        return laid_out_copy(self.model, memo, room=room)


#: Container types whose empty instances :meth:`SharedSetup.copy_model` copies itself.
_EMPTY_COPIES: tuple[type, ...] = (OrderedDict, dict, set)


def initial_model(config: TrainConfig, vocab_size: int, device: torch.device) -> torch.nn.Module:
    """The run's initial model (built from the seed, or loaded from --init-from)."""
    if config.run.init_from is None:
        return build_model(config.model, vocab_size).to(device)
    # --init-from: the saved weights, loaded straight into the model (pre-flight checked
    # that they fit); the architecture is the directory's config.json.
    from lowcomm.models.init_from import preflight_init_from

    return preflight_init_from(config.run.init_from, config.model).load().to(device)


def shared_setup(
    config: TrainConfig, task: Task | None = None, *, whole_run: bool = True
) -> SharedSetup:
    """Build what the in-process workers of ``config`` share (uses the process-global
    generator once, before any worker starts, as a worker process's set-up does); ``task``:
    the run's model, data and loss (default: :class:`CorpusTask`). ``whole_run``: every worker
    of the run is in this process (False: one of several processes of several workers)."""
    task = CorpusTask() if task is None else task
    corpus = task.corpus(config) if isinstance(task, CorpusTask) else None
    device = torch.device(config.placement.device)
    torch.manual_seed(config.run.seed)
    model = task.model(config).to(device)
    rng_state = torch.get_rng_state()
    validation = task.validation(config) if isinstance(task, CorpusTask) else None
    return SharedSetup(corpus, model, rng_state, validation, whole_run=whole_run)
