"""``lowcomm.fit``: a whole run (network emulation, the clock, metrics, checkpoints, resume,
plots) on your model, your data and your loss, from Python.

``fit`` builds a :class:`~lowcomm.config.TrainConfig` (the one ``lowcomm train`` parses from
its flags) and a task (:mod:`lowcomm.train.task`: the model, the data and the loss), and runs
them through :func:`lowcomm.launch.run.run_training`, the launch path of ``lowcomm train``:
the same checks, the same worker processes, the same loop. With no model and no data it *is*
``lowcomm train``.

Worker processes import what they run: the model factory, the datasets, the loss and the
collate function must be importable (defined at the top level of a module, or of the script
being run). Objects defined in a notebook or a REPL are not; so there (no ``__main__`` file)
``fit`` runs every worker on a thread of this process (``workers_per_process = workers``, where
in-process workers can run: 2 or more, see ``TrainConfig.placement_refusal``), and in process
mode it names what the workers cannot import before any worker starts.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import os
import pickle
import re
import sys
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from lowcomm.config import ConfigError, TrainConfig
from lowcomm.train.task import CorpusTask, LossFn, Task, qualified_name
from lowcomm.train.user_task import (
    BatchStreamTask,
    CollateFn,
    DatasetTask,
    MapData,
    ModuleCopy,
)


@dataclass(frozen=True)
class FitResult:
    """What :func:`fit` returns."""

    summary: dict[str, Any] | None
    """The run's summary.json (None: the run stopped early, ``stop_after``)."""
    run_dir: Path
    """The run directory: config.json, metrics.jsonl, summary.json, loss.png, checkpoints/,
    model/ (a user model's ``state_dict.pt``)."""


def fit(
    model: Callable[[], nn.Module] | nn.Module | None = None,
    train_data: MapData | str | os.PathLike[str] | None = None,
    val_data: MapData | None = None,
    *,
    loss_fn: LossFn | None = None,
    collate_fn: CollateFn | None = None,
    split_key: Callable[[Any], Hashable] | None = None,
    method: str | None = None,
    options: object | None = None,
    workers: int | None = None,
    steps: int | None = None,
    batch_size: int | None = None,
    network: str | None = None,
    clock: Literal["real", "virtual"] | None = None,
    out: str | os.PathLike[str] | None = None,
    resume: bool = False,
    overwrite: bool = False,
    config: TrainConfig | None = None,
) -> FitResult:
    """Train ``model`` on ``train_data`` with a lowcomm method over an emulated network.

    Args:
        model: a zero-argument factory returning a fresh ``nn.Module`` (a class, or a
            function of an importable module), or a module (each worker trains a copy);
            None: the built-in model of ``config.model`` (``lowcomm train``'s ``--model.*``).
        train_data: a map-style dataset (``len`` and ``[i]``: a torch ``Dataset``, a Hugging
            Face ``datasets.Dataset``, a list), dealt to the workers per ``config.data.split``
            (iid by default); an iterable of batches (a DataLoader), dealt in turn; a path (``lowcomm train --data``: text, JSONL, parquet, a
            token file; batches of token windows ``(inputs, targets)``); None: the bundled
            corpus.
        val_data: a map-style validation dataset (None: no validation loss); a corpus
            validates on its held-out split.
        loss_fn: ``loss_fn(model, batch) -> scalar tensor`` (batch on the model's device);
            None: ``model(inputs, targets)`` returns ``(output, loss)`` (lowcomm's models).
        collate_fn: ``collate_fn(list of samples) -> batch``; None: torch's default_collate.
        split_key: non-IID: samples ordered by ``split_key(sample)``, a block per worker.
        method: a ``lowcomm methods`` name; options: its options (e.g.
            ``lowcomm.DiLoCoOptions(sync_every=8)``, the classes of ``--<group>.*``).
        workers, steps, network, clock, batch_size: ``config``'s fields of these names
            (``batch_size``: ``data.micro_batch_size``); None keeps ``config``'s.
        out, resume: the run directory (default: under ``runs/``, named after the settings);
            resume continues the run there from its latest checkpoint (exactly).
        overwrite: replace the run ``out`` holds; without it (or ``resume``) a directory
            holding a run is refused (re-running a cell never overwrites a run silently).
        config: every other setting, as ``lowcomm train`` takes them; not modified.

    Returns the run's summary and directory (a dataset run counts samples: ``samples`` and
    ``unit: "samples"`` where a language model's summary has ``tokens``). Raises ConfigError
    (a bad option, an object the workers cannot import: one line), WorkerFailed (traceback in
    the run's error.log) or Interrupted (Ctrl-C stopped every worker).
    """
    task = make_task(model, train_data, val_data, loss_fn, collate_fn, split_key)
    path = os.fspath(train_data) if isinstance(train_data, str | os.PathLike) else None
    run = fit_config(
        config, task, path, method=method, options=options, workers=workers, steps=steps,
        batch_size=batch_size, network=network, clock=clock, out=out, resume=resume,
        overwrite=overwrite,
    )  # fmt: skip
    return launch(run, task)


def make_task(
    model: Callable[[], nn.Module] | nn.Module | None,
    train_data: MapData | str | os.PathLike[str] | None,
    val_data: MapData | None,
    loss_fn: LossFn | None,
    collate_fn: CollateFn | None,
    split_key: Callable[[Any], Hashable] | None,
) -> Task:
    """The task :func:`fit`'s arguments describe."""
    factory = ModuleCopy(model) if isinstance(model, nn.Module) else model
    corpus = train_data is None or isinstance(train_data, str | os.PathLike)
    if corpus:
        for name, given in (("val_data", val_data), ("collate_fn", collate_fn),
                            ("split_key", split_key)):  # fmt: skip
            if given is not None:
                raise ConfigError(
                    f"fit: {name}= needs a dataset train_data (the corpus batches token windows "
                    f"and validates on its held-out split); drop it or pass a dataset"
                )
        return CorpusTask(model_factory=factory, loss_fn=loss_fn)
    if factory is None:
        raise ConfigError(
            "fit: model=None trains the built-in language model, which reads the corpus; pass "
            "model= (a factory or a module) for a dataset train_data"
        )
    if _is_stream(train_data):
        if collate_fn is not None or split_key is not None:
            raise ConfigError(
                "fit: collate_fn= and split_key= need a map-style train_data (len() and [i]); "
                "a stream of batches is dealt to the workers in turn, as it comes"
            )
        return BatchStreamTask(factory, train_data, val_data, loss_fn)
    if not (hasattr(train_data, "__len__") and hasattr(train_data, "__getitem__")):
        raise ConfigError(
            f"fit: train_data is a {type(train_data).__name__}, neither a map-style dataset "
            f"(len() and [i]) nor an iterable of batches; wrap it in a torch Dataset"
        )
    return DatasetTask(factory, train_data, val_data, loss_fn, collate_fn, split_key)


def _is_stream(data: Any) -> bool:
    """Whether ``data`` is an iterable of batches (a DataLoader, an IterableDataset, any
    iterable without ``[i]``) rather than a map-style dataset of samples."""
    from torch.utils.data import DataLoader, IterableDataset

    if isinstance(data, DataLoader | IterableDataset):
        return True
    return hasattr(data, "__iter__") and not hasattr(data, "__getitem__")


def fit_config(
    config: TrainConfig | None,
    task: Task,
    data_path: str | None,
    *,
    method: str | None,
    options: object | None,
    workers: int | None,
    steps: int | None,
    batch_size: int | None,
    network: str | None,
    clock: Literal["real", "virtual"] | None,
    out: str | os.PathLike[str] | None,
    resume: bool,
    overwrite: bool,
) -> TrainConfig:
    """A copy of ``config`` (default: ``lowcomm train``'s defaults) with fit's arguments
    (``data_path``: a path given as the training data, ``--data``)."""
    train = copy.deepcopy(config) if config is not None else TrainConfig()
    if method is not None:
        train.method = method
    if workers is not None:
        train.placement.workers = workers
    if steps is not None:
        train.run.steps = steps
    if network is not None:
        train.comm.network = network
    if clock is not None:
        train.comm.clock = clock
    if batch_size is not None:
        train.data = dataclasses.replace(train.data, micro_batch_size=batch_size)
    if data_path is not None:
        train.data = dataclasses.replace(train.data, data=data_path)
    if options is not None:
        _set_options(train, options)
    train.run.overwrite = overwrite or train.run.overwrite
    if out is not None:
        train.run.out = os.fspath(out)
    elif train.run.out is None and train.run.resume is None and not isinstance(task, CorpusTask):
        from lowcomm.train.rundir import run_directory

        name = qualified_name(getattr(task, "model_factory", task)).rsplit(".", 1)[-1]
        train.run.out = str(Path("runs") / f"{name}-{run_directory(train).name}")
    if _interactive() and train.placement.workers_per_process == 1 and _in_process_fits(train):
        # (threads: nothing to import or pickle)
        train.placement.workers_per_process = train.placement.workers
    if resume:
        from lowcomm.train.rundir import run_directory

        train.run.resume, train.run.out = str(run_directory(train)), None
    return train


def _interactive() -> bool:
    """Whether ``__main__`` is a notebook or a REPL (no file a worker process could run)."""
    return getattr(sys.modules.get("__main__"), "__file__", None) is None


def _in_process_fits(run: TrainConfig) -> bool:
    """Whether the run's workers can all be threads of this process (the in-process
    placement's limits)."""
    together = dataclasses.replace(
        run,
        placement=dataclasses.replace(run.placement, workers_per_process=run.placement.workers),
    )
    return run.placement.workers > 1 and together.placement_refusal() is None


def _set_options(run: TrainConfig, options: object) -> None:
    """Put the method's options object in its group (``run.diloco = options``, ...)."""
    from lowcomm.api import _checked_options
    from lowcomm.strategies import strategy_class

    try:
        cls = strategy_class(run.method)
        _checked_options(run.method, cls, options)
    except ValueError as error:
        raise ConfigError(str(error).replace("options:", "fit: options:", 1)) from None
    setattr(run, str(cls.options_field), options)


def launch(config: TrainConfig, task: Task) -> FitResult:
    """Run ``config`` on ``task`` (``lowcomm train``'s launch path): in worker processes, or
    with ``workers_per_process`` > 1 on threads of this process."""
    from lowcomm.launch.run import run_training
    from lowcomm.train.rundir import run_directory

    problem = None if config.placement.workers_per_process > 1 else unimportable(task)
    if problem is not None:  # (worker processes unpickle the task; threads share it)
        raise ConfigError(problem)
    try:
        summary = run_training(config, task=task)
    except ConfigError as error:  # (the run directory's refusals name fit's arguments)
        raise ConfigError(_fit_words(str(error))) from None
    return FitResult(summary=summary, run_dir=run_directory(config).resolve())


def _fit_words(message: str) -> str:
    """A launch refusal in fit's words where it names the run directory's flags."""
    message = re.sub(r"--resume \S+ to continue it", "resume=True to continue it", message)
    return message.replace("pass --overwrite", "pass overwrite=True").replace(
        "--out NEW_DIR", "out=NEW_DIR"
    )


def unimportable(task: Task) -> str | None:
    """Why the worker processes could not unpickle ``task`` (one line), or None.

    A spawned or forked-server worker re-imports every function and class by module and
    name: a lambda or a nested function cannot be pickled at all, and whatever is defined in
    ``__main__`` is found only when ``__main__`` is a file the worker can run (a script), not
    in a notebook or a REPL."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    found: list[str] = []

    class Finder(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, torch.Tensor):  # (its values need no check: skip the copy)
                return torch.empty, (0,)
            kind = obj if isinstance(obj, type) or callable(obj) else type(obj)
            if getattr(kind, "__module__", None) == "__main__" and main_file is None:
                found.append(getattr(kind, "__qualname__", repr(kind)))
            return NotImplemented

    try:
        Finder(io.BytesIO()).dump(task)
    except Exception as error:  # (any failure to pickle is the answer)
        if found:
            return _in_main(found[0])
        return (
            f"fit: the model, data, loss or collate function cannot be sent to the worker "
            f"processes ({type(error).__name__}: {error}); define it at the top level of a "
            f"module (a .py file) and import it from there"
        )
    return _in_main(found[0]) if found else None


def _in_main(name: str) -> str:
    return (
        f"fit: {name} is defined in __main__ (a notebook or REPL), which worker processes "
        f"cannot import; move it into a module (a .py file beside the notebook) and import it "
        f"from there, or run the workers in this process (workers_per_process = workers)"
    )
