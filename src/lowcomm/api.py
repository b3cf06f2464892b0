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

from typing import Literal

from torch import nn

from lowcomm.comm.base import Comm
from lowcomm.comm.clock import ClockKind, make_clock
from lowcomm.comm.emulated import NetworkComm
from lowcomm.comm.local import LocalComm
from lowcomm.comm.network import NetworkProfile
from lowcomm.optim.adamw import AdamWConfig
from lowcomm.optim.schedule import ScheduleConfig
from lowcomm.strategies import Strategy, StrategyContext, strategy_class


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
        ValueError: for cuda without enough GPUs on this node, naming the fix.
    """
    import os

    import torch
    import torch.distributed as dist

    inner: Comm
    bound = torch.device("cpu")
    if dist.is_available() and not dist.is_initialized() and "WORLD_SIZE" in os.environ:
        from lowcomm.launch.spawn import init_from_env

        init_from_env(device=device, timeout_s=timeout_s)
    if dist.is_available() and dist.is_initialized():
        from lowcomm.comm.torch_comm import TorchComm

        if dist.get_backend() == "nccl" and device != "cuda":
            raise ValueError(
                "connect: the process group is NCCL, which moves GPU tensors only; pass "
                "device='cuda' (and move the model to comm.device)"
            )
        if device == "cuda":
            bound = torch.device("cuda", torch.cuda.current_device())
        inner = TorchComm(timeout_s=timeout_s)
    else:
        if device == "cuda":
            bound = torch.device("cuda", torch.cuda.current_device())
        inner = LocalComm()
    profile = NetworkProfile.from_preset(
        network, bandwidth_gbps=bandwidth_gbps, latency_ms=latency_ms, speed_factors=speed_factors
    )
    worker_clock = make_clock(clock, speed_factor=profile.speed_factor(inner.rank), device=bound)
    return NetworkComm(inner, profile, worker_clock, device=bound)


def make_strategy(
    method: str,
    model: nn.Module,
    comm: Comm,
    *,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.95),
    weight_decay: float = 0.1,
    total_steps: int = 100,
    warmup_steps: int = 0,
    microbatches_per_step: int = 1,
    max_grad_norm: float | None = 1.0,
    options: object | None = None,
) -> Strategy:
    """Build the strategy ``method`` around ``model``.

    ``options`` is the method family's options dataclass (for example
    ``DiLoCoOptions(sync_every=32)`` for ``diloco``); None uses the family's defaults.

    Raises:
        ValueError: for an unknown method or an invalid hyperparameter, naming the fix.
    """
    context = StrategyContext(
        optim=AdamWConfig(lr=lr, betas=betas, weight_decay=weight_decay),
        schedule=ScheduleConfig(kind="cosine", warmup_steps=warmup_steps),
        total_steps=total_steps,
        microbatches_per_step=microbatches_per_step,
        max_grad_norm=max_grad_norm,
    )
    cls = strategy_class(method)
    if options is None or cls.options_field is None:
        if options is not None:
            raise ValueError(f"options: method {method!r} takes no options; drop the argument")
        return cls(model, comm, context)
    return cls(model, comm, context, options=options)  # type: ignore[call-arg]
