"""DES-LOC family: DES-LOC, Local Adam, FedAvg keeping or resetting optimizer state.

Paper: Iacob et al., *DES-LOC: Desynced Low Communication Adaptive Optimizers for Training
Foundation Models* (../shared/seeds/004_ec2947a810b7b994.txt); update rules as restated in
docs/ALGORITHMS.md §5 (5.1-5.6), which this module follows over the paper's extracted text.

Every worker runs its own inner optimizer (Adam, ADOPT or SGD with momentum) on its own data
and its own copy of the parameters ``x`` and of every optimizer state ``s_j`` (first moment
``u``, second moment ``v``). State ``j`` is averaged across workers (blocking all-reduce, mean)
every ``K_j`` steps, independently of the others:

==============  =====================  ===========================  =============================
method          K_x (parameters)       K_u, K_v (moments)           after a parameter sync
==============  =====================  ===========================  =============================
desloc          param_period           first/second_moment_period   nothing
local_adam      param_period = K       K, K                         nothing
favg_opt        param_period = K       never (states stay local)    nothing
favg_reset      param_period = K       never                        u = v = 0, counters = 0
==============  =====================  ===========================  =============================

Symbols -> arguments: K_x -> ``DeslocOptions.param_period``, K_u -> ``first_moment_period``,
K_v -> ``second_moment_period``, rho -> ``clip_rho``, eta_t -> ``context.optim.lr`` through the
schedule, (beta1, beta2) -> ``DeslocOptions.betas`` (default ``--optim.betas``; ADOPT's
(0.9, 0.9999)), epsilon -> ``DeslocOptions.eps``, M -> ``comm.world_size``.

One step on worker m, 0-based step index t (``Strategy.step_index`` before the step)::

    g_hat <- clip(grad f(x_m; xi_m), rho)                  # coordinate-wise, then optional
                                                            # global-norm clip (max_grad_norm)
    (u, v, x) <- inner optimizer update with g_hat          # Adam / ADOPT / SGDM
    for every state j in {x, u, v} with (t + 1) mod K_j == 0:
        s_j <- AR_mean(s_j)                                 # all due states in ONE all-reduce

*Ordering.* docs/ALGORITHMS.md §5.5 leaves the ordering open: "average, then apply the local
update" at ``t mod K_j == 0`` versus "update, then average at the end of the period" (the
torchft port). We use the latter. Both differ only in where one local step lands; ours has
the property that the next gradient is always evaluated at freshly averaged parameters, so
with all periods 1 and SGD with momentum (linear in the gradient) the averaged iterate is
*exactly* DDP with SGDM on the mean gradient, for any data split (tests/test_desloc.py). It also
gives "step 0: no sync" for free: the first sync of state j follows step K_j - 1.

*Bias correction* (Adam) uses a step counter per moment that is global: it counts the steps
since the state started and is never reset (except by favg_reset, docs/ALGORITHMS.md §5.4). On a
worker that never rejoined the counters equal the global step. When a moment is averaged the
counter is set to the global step, because the averaged moment carries the other workers'
full history: this is what makes a rejoining worker's bias correction right after it receives
averaged state.

*Fused syncs.* When several states fall due on the same step they travel in one all-reduce
over their concatenation (one latency instead of up to three, docs/ALGORITHMS.md §5.5), issued with
``segments=[(role, numel), ...]`` so the communicator charges every role exactly its own
share of the bytes (the ring model's bytes are linear in the payload). Total bytes and the
modeled time are those of the single fused collective. ``--desloc.fuse False`` issues one
collective per role instead, launched back to back and waited together (one latency per
role).

*Joining workers* (docs/ALGORITHMS.md §5.5, edge cases). :meth:`Desloc.rejoin` gives this worker
fresh optimizer state (zero moments, counters 0; ADOPT re-seeds v from its next gradient), as a
worker restarted after a failure; optionally it also loads given parameters. Nothing else
happens: the worker receives the averaged parameters at the next parameter sync and the
averaged moments at their own next syncs (where its fresh state enters the mean with weight
1/M). Under favg_opt its moments are never synced, so it keeps its own fresh state for good
(the lasting harm the paper reports, §7.3 F4). ``--desloc.rejoin-rank`` and
``--desloc.rejoin-step`` trigger it from the command line.

*Validation* (``deployed``) uses this worker's own parameters: between syncs workers differ,
and the loop averages the validation loss over workers, i.e. the mean loss of the local
models. ``finish()`` averages the parameters once more unless the last step just did
("End of training: final AR of x").

Communication per step (payloads of Psi): desloc 1/K_x + 1/K_u + 1/K_v; local_adam 3/K;
favg_opt and favg_reset 1/K; DDP 1. With SGDM there is no second moment, so K_v is unused and
desloc moves 1/K_x + 1/K_u.

Reduces to: DDP with SGDM when all periods are 1 and ``optimizer="sgdm"`` without clipping;
``local_adam`` equals ``desloc`` with all three periods equal (tests/test_desloc.py checks both).
Memory: parameters + gradients + moments, as DDP ((2 + 2 + K) Psi, docs/ALGORITHMS.md §0.2).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from lowcomm.comm.base import Comm, Handle, Role
from lowcomm.optim.adamw import AdamWConfig, FlatAdamW
from lowcomm.optim.adopt import AdoptConfig, FlatAdopt
from lowcomm.optim.flat import FlatOptimizer, tensor_bytes
from lowcomm.optim.sgd import FlatSGD
from lowcomm.strategies.base import Closure, StepStats, Strategy, StrategyContext
from lowcomm.strategies.declaration import CostModel, MembershipRule, state_traffic
from lowcomm.strategies.gradient_step import accumulate, average_and_clip, step_and_publish
from lowcomm.strategies.sharded_flat import flat_buffers, norm_summer, whole_norm

#: Order of states inside a fused all-reduce (and the role the fused call is issued under).
SYNC_ORDER: tuple[Role, ...] = (Role.PARAMETER, Role.FIRST_MOMENT, Role.SECOND_MOMENT)

_EXTRA_NAMES = {
    Role.PARAMETER: "synced_parameters",
    Role.FIRST_MOMENT: "synced_first_moment",
    Role.SECOND_MOMENT: "synced_second_moment",
}


def half_life(beta: float) -> float:
    """Steps after which an exponential moving average with decay ``beta`` has forgotten half
    of its past: ``tau_0.5(beta) = ln 0.5 / ln beta`` (docs/ALGORITHMS.md §5.1).

    Raises:
        ValueError: for ``beta`` outside (0, 1).
    """
    if not 0.0 < beta < 1.0:
        raise ValueError(f"beta: {beta} must lie in (0, 1) for a finite half-life; try 0.9")
    return math.log(0.5) / math.log(beta)


def half_lives(betas: tuple[float, float]) -> dict[str, float]:
    """Half-lives in steps of the first and second moment for ``betas = (beta1, beta2)``.

    Example: ``half_lives((0.9, 0.999))`` is about ``{"first_moment": 6.6,
    "second_moment": 692.8}``; DES-LOC's advice is to sync each state at a period proportional
    to its half-life (parameters, which do not decay at all, most often).
    """
    return {"first_moment": half_life(betas[0]), "second_moment": half_life(betas[1])}


@dataclass(kw_only=True)
class DeslocOptions:
    """Options of the DES-LOC family: desloc, local_adam, favg_opt and favg_reset.

    Default periods (docs/ALGORITHMS.md §5.5): K_u = 3 K_x and K_v = 6 K_x. Reasoning: a moment
    with decay beta forgets half of itself in tau_0.5 = ln 0.5 / ln beta steps (6.6 steps at
    0.9, 693 at 0.999, see :func:`half_lives`), and between syncs it drifts by at most
    2 rho (1 - beta1^K) (first moment) and rho^2 (1 - beta2^K) (second moment). The slower a
    state moves, the longer it can stay local; parameters, which never decay, are synced most
    often. With these defaults DES-LOC sends 1/K + 1/(3K) + 1/(6K) = 1.5/K payloads per step,
    exactly half of Local Adam's 3/K at K = K_x.
    """

    param_period: int = 16
    """K_x: average the parameters every this many steps (K for local_adam, favg_opt and
    favg_reset)."""

    first_moment_period: int | None = None
    """K_u (desloc only): average the first moment every this many steps (default 3 K_x)."""

    second_moment_period: int | None = None
    """K_v (desloc only): average the second moment every this many steps (default 6 K_x)."""

    optimizer: Literal["adam", "adopt", "sgdm"] = "adam"
    """Inner optimizer: adam (bias-corrected on a global step counter), adopt, or sgdm (SGD
    with momentum u <- beta1 u + (1 - beta1) g)."""

    betas: tuple[float, float] | None = None
    """(beta1, beta2) of the inner optimizer (default: --optim.betas for adam and sgdm,
    (0.9, 0.9999) for adopt; sgdm uses beta1 only)."""

    eps: float | None = None
    """Epsilon (default: --optim.eps for adam, 1e-6 for adopt)."""

    clip_rho: float | None = 1.0
    """rho: clip every gradient coordinate to [-rho, rho] before the state updates (None:
    off). --max-grad-norm, if set, then clips the local gradient's L2 norm as well."""

    fuse: bool = True
    """Send states that sync on the same step in one all-reduce (False: one per state)."""

    final_sync: bool = True
    """Average the parameters at the end of training unless the last step just did."""

    track_state_change: bool = False
    """Report the relative change ||s_t+1 - s_t|| / ||s_t|| of u and v each step in the step
    extras (costs a copy of the moments per step)."""

    rejoin_rank: int | None = None
    """Worker that rejoins with fresh optimizer state (as after a failure), with --desloc.rejoin-step."""

    rejoin_step: int | None = None
    """0-based step at whose start --desloc.rejoin-rank drops its optimizer state."""

    def __post_init__(self) -> None:
        for flag, value in (
            ("--desloc.param-period", self.param_period),
            ("--desloc.first-moment-period", self.first_moment_period),
            ("--desloc.second-moment-period", self.second_moment_period),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{flag}: {value} must be >= 1; pass a number of steps such as 16")
        if self.optimizer not in ("adam", "adopt", "sgdm"):
            raise ValueError(
                f"--desloc.optimizer: unknown {self.optimizer!r}; choose adam, adopt or sgdm"
            )
        if self.betas is not None:
            if len(self.betas) != 2:
                raise ValueError(
                    f"--desloc.betas: {self.betas} must be two numbers (beta1 beta2), e.g. 0.9 0.999"
                )
            for index, beta in enumerate(self.betas):
                if not 0.0 <= beta < 1.0:
                    raise ValueError(
                        f"--desloc.betas: beta{index + 1} = {beta} must lie in [0, 1); try 0.9 0.999"
                    )
        if self.eps is not None and not (self.eps > 0 and math.isfinite(self.eps)):
            raise ValueError(f"--desloc.eps: {self.eps} must be a positive number; try 1e-8")
        if self.clip_rho is not None and not (self.clip_rho > 0):
            raise ValueError(
                f"--desloc.clip-rho: {self.clip_rho} must be positive, or None to disable; try 1.0"
            )
        if (self.rejoin_rank is None) != (self.rejoin_step is None):
            raise ValueError(
                f"--desloc.rejoin-rank ({self.rejoin_rank}) and --desloc.rejoin-step "
                f"({self.rejoin_step}) go together; pass both or neither"
            )
        if self.rejoin_step is not None and self.rejoin_step < 0:
            raise ValueError(f"--desloc.rejoin-step: {self.rejoin_step} must be >= 0")
        if self.rejoin_rank is not None and self.rejoin_rank < 0:
            raise ValueError(f"--desloc.rejoin-rank: {self.rejoin_rank} must be >= 0")


# --- inner optimizer --------------------------------------------------------------------------


def make_inner_optimizer(
    master: torch.Tensor, options: DeslocOptions, optim: AdamWConfig
) -> FlatOptimizer:
    """The inner optimizer ``options.optimizer`` over ``master`` (weight decay from ``optim``).

    adam: :class:`~lowcomm.optim.adamw.FlatAdamW`, one bias-correction counter per moment set to
    the global step when that moment is averaged; adopt: :class:`~lowcomm.optim.adopt.FlatAdopt`;
    sgdm: :class:`~lowcomm.optim.sgd.FlatSGD` with the EMA momentum u <- beta1 u + (1 - beta1) g.
    """
    if options.optimizer == "adam":
        betas = options.betas or optim.betas
        eps = options.eps if options.eps is not None else optim.eps
        return FlatAdamW(master, replace(optim, betas=betas, eps=eps))
    if options.optimizer == "adopt":
        config = AdoptConfig(
            betas=options.betas or (0.9, 0.9999),
            eps=options.eps if options.eps is not None else 1e-6,
            weight_decay=optim.weight_decay,
        )
        return FlatAdopt(master, config)
    beta = (options.betas or optim.betas)[0]
    return FlatSGD(master, weight_decay=optim.weight_decay, momentum=beta, dampening="ema")


# --- strategies -------------------------------------------------------------------------------


class Desloc(Strategy):
    """DES-LOC: parameters and each optimizer moment averaged on their own periods.

    Paper: DES-LOC (Iacob et al.), Alg. 1 with Adam (Alg. 2), ADOPT or SGDM (Alg. 4);
    docs/ALGORITHMS.md §5.5. Symbols: K_x -> options.param_period, K_u ->
    options.first_moment_period (default 3 K_x), K_v -> options.second_moment_period (default
    6 K_x), rho -> options.clip_rho. Reduces to: DDP with SGDM when every period is 1
    (optimizer sgdm, no clipping); to local_adam when K_x = K_u = K_v.

    Elastic resume (``--resume DIR --workers M2``): the local parameters and both Adam moments
    are averaged over the old workers (an early synchronisation of every state); counters are
    kept.
    """

    name: ClassVar[str] = "desloc"
    muon_refusal: ClassVar[str | None] = (
        "the DES-LOC family averages the optimizer's moments on their own periods and Muon "
        "has no master-sized moments"
    )
    cost: ClassVar[CostModel] = CostModel(
        description="params/moments synced at own periods",
        traffic=lambda o, t: state_traffic(Desloc.sync_periods(o), o.fuse),
        schedule=lambda o: (
            f"K_x = {o.param_period}, K_u = {o.first_moment_period or 3 * o.param_period}, "
            f"K_v = {o.second_moment_period or 6 * o.param_period}"
        ),
    )
    options_field: ClassVar[str | None] = "desloc"
    sharding_refusal: ClassVar[str | None] = None
    quick_options: ClassVar[Mapping[str, object]] = {
        "param_period": 2, "first_moment_period": 2, "second_moment_period": 4,
    }  # fmt: skip
    #: Zero the moments and counters after every parameter sync (FedAvg with reset state).
    reset_after_parameter_sync: ClassVar[bool] = False
    membership: ClassVar[MembershipRule | None] = MembershipRule(
        round="sync",
        global_state="the step counter and the sending member's parameters",
        worker_state=(
            "join: the parameters start as the sending member's and the moments afresh (zero, "
            "counters 0), to be averaged in at their next syncs; rejoin: the moments kept"
        ),
    )

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        context: StrategyContext,
        options: DeslocOptions | None = None,
    ) -> None:
        super().__init__(model, comm, context)
        self.options = options if options is not None else DeslocOptions()
        self.periods: dict[Role, int | None] = self.sync_periods(self.options)
        if self.options.rejoin_rank is not None and self.options.rejoin_rank >= comm.world_size:
            raise ValueError(
                f"--desloc.rejoin-rank: {self.options.rejoin_rank} is not a worker of a group of "
                f"{comm.world_size}; pass a rank in 0..{comm.world_size - 1}"
            )
        self.flat = flat_buffers(model)  # the local shards on a sharded worker
        # fp32 parameters are their own master copy; other dtypes keep an fp32 clone (on CPU
        # .float() of fp32 would alias, so clone explicitly).
        if self.flat.dtype == torch.float32:
            master = self.flat.params
        else:
            master = self.flat.params.float().clone()
        self.inner: FlatOptimizer = make_inner_optimizer(master, self.options, context.optim)
        self.last_synced: list[Role] = []

    # -- configuration --

    @classmethod
    def sync_periods(cls, options: DeslocOptions) -> dict[Role, int | None]:
        """The period K_j of every state (None: never synced)."""
        k_x = options.param_period
        return {
            Role.PARAMETER: k_x,
            Role.FIRST_MOMENT: options.first_moment_period or 3 * k_x,
            Role.SECOND_MOMENT: options.second_moment_period or 6 * k_x,
        }

    def payloads_per_step(self) -> float:
        """Expected model-sized payloads averaged per step: sum over synced states of 1/K_j."""
        present = {Role.PARAMETER, *self.inner.states()}
        return sum(1.0 / k for role, k in self.periods.items() if k is not None and role in present)

    # -- the step --

    def _gradient(self) -> torch.Tensor:
        """The local gradient, clipped per coordinate (rho) and, if set, by its L2 norm."""
        return average_and_clip(
            self.flat.grads,
            count=self.context.microbatches_per_step,
            max_grad_norm=self.context.max_grad_norm,
            coordinate_clip=self.options.clip_rho,
            sum_squared_norm=norm_summer(self.flat),
        )

    def step(self, closure: Closure) -> StepStats:
        if (
            self.options.rejoin_step is not None
            and self.step_index == self.options.rejoin_step
            and self.comm.rank == self.options.rejoin_rank
        ):
            self.rejoin()
        loss, samples, tokens = accumulate(
            self.flat, closure, self.context.microbatches_per_step, self.runtime.replica_group
        )
        lr = self.lr_at(self.step_index)
        extras: dict[str, float] = {}
        with torch.no_grad():
            grad = self._gradient()
            before = (
                {role: state.clone() for role, state in self.inner.states().items()}
                if self.options.track_state_change
                else {}
            )
            step_and_publish(self.inner, grad, lr=lr, flat=self.flat)
            for role, previous in before.items():
                current = self.inner.states()[role]
                norm = whole_norm(self.flat, previous)
                name = (
                    "first_moment_change" if role is Role.FIRST_MOMENT else "second_moment_change"
                )
                change = whole_norm(self.flat, current - previous)
                extras[name] = change / norm if norm > 0 else math.nan
        self.step_index += 1
        due = self.due_roles(self.step_index)
        self.synchronize(due)
        if self.reset_after_parameter_sync and Role.PARAMETER in due:
            self.inner.reset()
        for role in SYNC_ORDER:
            extras[_EXTRA_NAMES[role]] = 1.0 if role in due else 0.0
        return StepStats(
            loss=loss,
            microbatches=self.context.microbatches_per_step,
            samples=samples,
            tokens=tokens,
            lr=lr,
            extras=extras,
        )

    def due_roles(self, completed_steps: int) -> list[Role]:
        """States whose period divides ``completed_steps`` (in fused order)."""
        present = {Role.PARAMETER, *self.inner.states()}
        due = []
        for role in SYNC_ORDER:
            period = self.periods[role]
            if role in present and period is not None and completed_steps % period == 0:
                due.append(role)
        return due

    # -- communication --

    def _tensor_of(self, role: Role) -> torch.Tensor:
        return self.inner.master if role is Role.PARAMETER else self.inner.states()[role]

    def synchronize(self, roles: list[Role]) -> None:
        """Average the states ``roles`` across workers (one fused all-reduce if enabled)."""
        self.last_synced = list(roles)
        if not roles:
            return
        self.runtime.enter_round()  # (a member lost since the last sync: its detection)
        tensors = [self._tensor_of(role) for role in roles]
        with torch.no_grad():
            if len(roles) > 1 and self.options.fuse:
                buffer = torch.cat(tensors)
                segments = [
                    (role, tensor.numel()) for role, tensor in zip(roles, tensors, strict=True)
                ]
                self.comm.all_reduce(buffer, op="mean", role=roles[0], segments=segments).wait()
                offset = 0
                for tensor in tensors:
                    tensor.copy_(buffer[offset : offset + tensor.numel()])
                    offset += tensor.numel()
            else:
                # Launched back to back, waited together: the link queues them, nothing idles.
                handles: list[Handle] = [
                    self.comm.all_reduce(tensor, op="mean", role=role)
                    for role, tensor in zip(roles, tensors, strict=True)
                ]
                for handle in handles:
                    handle.wait()
            self.inner.on_states_averaged(roles, self.step_index)
            self._publish_master()

    def _publish_master(self) -> None:
        if self.inner.master is not self.flat.params:
            self.flat.params.copy_(self.inner.master)

    # -- membership (declared faults) --

    def round_committed(self, stats: StepStats) -> bool:
        return stats.extras.get(_EXTRA_NAMES[Role.PARAMETER]) == 1.0

    def global_state(self) -> tuple[list[tuple[Role, torch.Tensor]], dict[str, int]]:
        return [(Role.PARAMETER, self.inner.master)], {"step_index": self.step_index}

    def set_global_counters(self, counters: dict[str, int]) -> None:
        self.step_index = counters["step_index"]

    def start_worker_state(self, *, kept: bool) -> None:
        if not kept:
            self.inner.reset()
        with torch.no_grad():
            self._publish_master()

    # -- joining --

    def rejoin(self, parameters: torch.Tensor | None = None) -> None:
        """Continue as a worker that (re)joined with fresh optimizer state.

        Zeroes this worker's moments and their counters (ADOPT re-seeds v from its next
        gradient). With ``parameters`` (a flat tensor of the model's trainable parameters,
        e.g. a stale checkpoint) they are loaded too. The worker then receives the averaged
        parameters at the next parameter sync and the averaged moments at their next syncs.
        Only this worker calls it; the others' collectives are unchanged.
        """
        self.inner.reset()
        if parameters is not None:
            if parameters.numel() != self.flat.numel:
                raise ValueError(
                    f"rejoin: got {parameters.numel()} parameters, the model has "
                    f"{self.flat.numel}; pass the flat trainable parameters of this model"
                )
            with torch.no_grad():
                self.inner.master[: self.flat.numel].copy_(parameters.reshape(-1))
                self._publish_master()

    # -- lifecycle --

    def finish(self) -> None:
        k_x = self.periods[Role.PARAMETER]
        if (
            self.options.final_sync
            and self.step_index > 0
            and k_x is not None
            and self.step_index % k_x
        ):
            self.synchronize([Role.PARAMETER])

    def state_bytes(self) -> int:
        master = 0 if self.inner.master is self.flat.params else tensor_bytes(self.inner.master)
        return self.flat.bytes + self.inner.state_bytes() + master

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "optimizer": self.inner.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        with torch.no_grad():
            self.inner.load_state_dict(state["optimizer"])
            self._publish_master()


class _SinglePeriod(Desloc):
    """Shared by the baselines whose only period is --desloc.param-period."""

    quick_options: ClassVar[Mapping[str, object]] = {"param_period": 2}

    @classmethod
    def _reject_moment_periods(cls, options: DeslocOptions) -> None:
        for flag, value in (
            ("--desloc.first-moment-period", options.first_moment_period),
            ("--desloc.second-moment-period", options.second_moment_period),
        ):
            if value is not None:
                raise ValueError(
                    f"{flag}: {value} is only used by --method desloc; {cls.name} sets its periods "
                    f"from --desloc.param-period alone, so drop {flag} or use desloc"
                )


class LocalAdamMethod(_SinglePeriod):
    """Local Adam: parameters and both moments averaged every K steps.

    Paper: Cheng & Glasgow 2025 as the DES-LOC baseline; docs/ALGORITHMS.md §5.2. Symbols: K ->
    options.param_period (K_x = K_u = K_v = K); 3/K payloads per step. Reduces to: desloc with
    all three periods K (tests/test_desloc.py). Not DDP-Adam even at K = 1: averaging v is not
    squaring the averaged gradient.
    """

    name: ClassVar[str] = "local_adam"
    cost: ClassVar[CostModel] = CostModel(
        description="params and both moments every K",
        traffic=lambda o, t: state_traffic(LocalAdamMethod.sync_periods(o), o.fuse),
        schedule=lambda o: f"K = {o.param_period}",
    )

    @classmethod
    def sync_periods(cls, options: DeslocOptions) -> dict[Role, int | None]:
        cls._reject_moment_periods(options)
        k = options.param_period
        return {Role.PARAMETER: k, Role.FIRST_MOMENT: k, Role.SECOND_MOMENT: k}


class FavgOpt(_SinglePeriod):
    """FedAvg keeping optimizer state: only parameters averaged every K; moments stay local.

    Paper: DES-LOC baseline FAVG+OPT (Photon/DiLoCo with outer SGD lr 1); docs/ALGORITHMS.md §5.3.
    Symbols: K -> options.param_period, K_u = K_v = infinity; 1/K payloads per step.
    """

    name: ClassVar[str] = "favg_opt"
    cost: ClassVar[CostModel] = CostModel(
        description="params every K, states kept",
        traffic=lambda o, t: state_traffic(FavgOpt.sync_periods(o), o.fuse),
        schedule=lambda o: f"K = {o.param_period}",
    )

    @classmethod
    def sync_periods(cls, options: DeslocOptions) -> dict[Role, int | None]:
        cls._reject_moment_periods(options)
        return {
            Role.PARAMETER: options.param_period,
            Role.FIRST_MOMENT: None,
            Role.SECOND_MOMENT: None,
        }


class FavgReset(FavgOpt):
    """FedAvg resetting optimizer state: average parameters every K, then zero u, v, counters.

    Paper: DES-LOC baseline FAVG-OPT; docs/ALGORITHMS.md §5.4. Symbols: K -> options.param_period;
    1/K payloads per step. Expect a loss spike after each sync (fresh Adam state).
    """

    name: ClassVar[str] = "favg_reset"
    cost: ClassVar[CostModel] = CostModel(
        description="params every K, states reset",
        traffic=lambda o, t: state_traffic(FavgReset.sync_periods(o), o.fuse),
        schedule=lambda o: f"K = {o.param_period}",
    )
    reset_after_parameter_sync: ClassVar[bool] = True


METHODS: tuple[type[Strategy], ...] = (Desloc, LocalAdamMethod, FavgOpt, FavgReset)
