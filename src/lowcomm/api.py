"""The small public API for using a lowcomm strategy inside your own training loop.

In a script started by ``torchrun`` (or by :func:`lowcomm.launch.spawn_workers`)::

    comm = lowcomm.connect(network="wan", device="cuda")         # once, after start-up
    strategy = lowcomm.make_strategy("zero1", model, comm, lr=1e-3, total_steps=100)
    for batch in loader:
        def closure():                                           # your forward + backward
            loss = loss_fn(model(batch.x), batch.y); loss.backward()
            return lowcomm.MicroBatchResult(loss.item(), len(batch.x), len(batch.x))
        stats = strategy.step(closure)                           # replaces opt.step()

Without a process group, ``connect`` gives a single-worker communicator, so the same script
runs unchanged on a laptop. With ``device="cuda"`` it drives ``cuda:LOCAL_RANK`` over NCCL: move
the model there (``model.to(comm.device)``) before ``make_strategy``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import nn

from lowcomm.comm.base import Comm
from lowcomm.comm.clock import ClockKind, make_clock
from lowcomm.comm.emulated import NetworkComm
from lowcomm.comm.local import LocalComm
from lowcomm.comm.network import LinkNames, NetworkProfile
from lowcomm.optim.adamw import AdamWConfig
from lowcomm.optim.schedule import ScheduleConfig
from lowcomm.strategies import (
    STRATEGIES,
    Strategy,
    StrategyContext,
    options_class,
    strategy_class,
)
from lowcomm.strategies.option_groups import group_members

#: How :func:`connect`'s link arguments are named when one is refused.
_CONNECT_ARGUMENTS = LinkNames(
    "connect(network=)",
    "connect(bandwidth_gbps=)",
    "connect(latency_ms=)",
    "connect(speed_factors=)",
)


def connect(
    *,
    network: str = "none",
    bandwidth_gbps: float | None = None,
    latency_ms: float | None = None,
    speed_factors: tuple[float, ...] = (),
    clock: ClockKind = "real",
    device: Literal["cpu", "cuda"] = "cpu",
    timeout_s: float = 300.0,
) -> NetworkComm:
    """A communicator over the current process group, charged for the declared network.

    Joins the group from torchrun's environment variables if it is not initialised yet (Gloo
    for ``device="cpu"``; NCCL for ``"cuda"``, after binding ``cuda:LOCAL_RANK`` and checking
    the node has that many GPUs); with no launcher at all, returns a single-worker
    communicator. The communicator's ``device`` is where its tensors must live.

    Args:
        device: cpu (Gloo) or cuda (NCCL, one GPU per process).
        timeout_s: a collective not complete after this long raises
            :class:`~lowcomm.comm.base.CollectiveTimeout` (the process group's own timeout
            is set longer, so this error comes first).

    Raises:
        ValueError: for a bad link setting, or cuda without enough GPUs on this node, naming
            the fix.
    """
    profile = NetworkProfile.from_preset(
        network,
        bandwidth_gbps=bandwidth_gbps,
        latency_ms=latency_ms,
        speed_factors=speed_factors,
        names=_CONNECT_ARGUMENTS,
    )

    inner, bound = _join_group(device, timeout_s)
    worker_clock = make_clock(clock, speed_factor=profile.speed_factor(inner.rank), device=bound)
    return NetworkComm(inner, profile, worker_clock, device=bound)


def _join_group(device: Literal["cpu", "cuda"], timeout_s: float) -> tuple[Comm, torch.device]:
    """This process's communicator over the process group (joined from torchrun's variables
    if it is not yet), or a group of one without a launcher; and the device it binds."""
    import os

    import torch.distributed as dist

    bound: torch.device | None = None
    if dist.is_available() and not dist.is_initialized() and "WORLD_SIZE" in os.environ:
        from lowcomm.launch.spawn import init_from_env

        init_from_env(device=device, timeout_s=timeout_s)
        if device == "cuda":  # init_from_env bound this process's GPU
            bound = torch.device("cuda", torch.cuda.current_device())
    if device == "cuda" and bound is None:
        group = _group_device(dist) if dist.is_available() and dist.is_initialized() else None
        bound = torch.device("cuda", connect_gpu(group, torch.cuda.current_device(), os.environ))
        torch.cuda.set_device(bound)
    if not (dist.is_available() and dist.is_initialized()):
        return LocalComm(), bound or torch.device("cpu")
    from lowcomm.comm.torch_comm import TorchComm

    if dist.get_backend() == "nccl" and device != "cuda":
        raise ValueError(
            "connect: the process group is NCCL, which moves GPU tensors only; pass "
            "device='cuda' (and move the model to comm.device)"
        )
    return TorchComm(timeout_s=timeout_s), bound or torch.device("cpu")


def _group_device(dist: Any) -> torch.device | None:
    """The GPU the default process group was bound to (``init_process_group(device_id=...)``),
    if any."""
    group = dist.distributed_c10d._get_default_group()
    bound = getattr(group, "bound_device_id", None)
    return bound if isinstance(bound, torch.device) else None


def connect_gpu(group: torch.device | None, current: int, environ: Mapping[str, str]) -> int:
    """The GPU index :func:`connect` uses on a process group it did not make: the group's
    bound device; else the current device when the caller set one (not 0); else
    ``LOCAL_RANK``'s (0 where the launcher gave this process a GPU of its own through a
    one-device ``CUDA_VISIBLE_DEVICES``); else the current device. Every rank of a node taking
    ``cuda:0`` because nobody called ``set_device`` would put them all on one GPU."""
    from lowcomm.launch.devices import given_own_gpu

    if group is not None and group.index is not None:
        return group.index
    if current != 0 or "LOCAL_RANK" not in environ:
        return current
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and given_own_gpu(1, visible):
        return 0
    return int(environ["LOCAL_RANK"])


def make_strategy(
    method: str,
    model: nn.Module,
    comm: Comm,
    *,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    weight_decay: float = 0.1,
    total_steps: int = 100,
    schedule: Literal["cosine", "constant"] = "cosine",
    warmup_steps: int = 0,
    min_lr_ratio: float = 0.1,
    microbatches_per_step: int = 1,
    max_grad_norm: float | None = 1.0,
    options: object | None = None,
    seed: int = 0,
    optimizer: Literal["adamw", "muon"] = "adamw",
) -> Strategy:
    """Build the strategy ``method`` around ``model``. The closure given to ``strategy.step``
    must draw a fresh micro-batch on every call: methods with a variable number of
    micro-batches (acco, dpu, wp) call it as often as fits while they communicate, and
    ``microbatches_per_step > 1`` several times too.

    Args:
        method: a ``lowcomm methods`` name.
        model: the single-device model; the strategy owns its parameters from now on.
        comm: from :func:`connect`.
        lr, betas, eps, weight_decay: the (inner) AdamW's peak learning rate, moment decays,
            denominator epsilon and decoupled weight decay.
        total_steps: optimizer steps the loop will take (the schedule's length).
        schedule, warmup_steps, min_lr_ratio: ``"cosine"`` (a linear warm-up from 0 over
            ``warmup_steps``, then cosine decay to ``min_lr_ratio x lr``) or ``"constant"``
            (``lr`` after the warm-up; with ``warmup_steps=0``, exactly ``lr`` throughout).
        microbatches_per_step: micro-batches accumulated per step (synchronous methods).
        max_grad_norm: clip the averaged gradient to this global L2 norm; None: no clipping.
        options: an instance of the options class the method declares (the type of its
            ``options`` argument, exported as ``lowcomm.<ClassName>``; its fields are
            ``train``'s ``--<group>.*``), e.g. ``lowcomm.DiLoCoOptions(sync_every=32)`` for
            diloco; None uses the defaults. A method without options (ddp) takes none.
        seed: the run's seed, the same on every worker (SPARTA's random indices come from it).
        optimizer: ``"adamw"``, or ``"muon"`` (``train``'s ``--optim.name``): Muon on the
            hidden matrices and AdamW with the settings above on the rest, with Muon's default
            settings; diloco with it is MuLoCo. Refused by the methods ``train`` refuses it for.

    Raises:
        ValueError: for an unknown method, an options object of another family, or an invalid
            hyperparameter, naming the fix.
    """
    context = StrategyContext(
        optim=AdamWConfig(name=optimizer, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay),
        schedule=ScheduleConfig(kind=schedule, warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio),
        total_steps=total_steps, microbatches_per_step=microbatches_per_step,
        max_grad_norm=max_grad_norm, seed=seed,
    )  # fmt: skip
    cls = strategy_class(method)
    if _checked_options(method, cls, options) is None:
        return cls(model, comm, context)
    return cls(model, comm, context, options=options)  # type: ignore[call-arg]


def _checked_options(method: str, cls: type[Strategy], options: object | None) -> object | None:
    """``options``, refused when it is not the options class ``cls`` declares."""
    expected = options_class(cls)
    if options is None or expected is None:
        if options is not None:
            raise ValueError(f"options: method {method!r} takes no options; drop the argument")
        return None
    if not isinstance(options, expected):
        family = sorted(group_members(STRATEGIES)[str(cls.options_field)])
        raise ValueError(
            f"options: {type(options).__name__} is not the options of method {method!r}; pass "
            f"lowcomm.{expected.__name__}(...) (the options of {', '.join(family)}), or None "
            f"for its defaults"
        )
    return options
