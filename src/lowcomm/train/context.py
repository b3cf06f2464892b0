"""What a run builds from its configuration for its strategy and its links.

:class:`~lowcomm.config.TrainConfig` holds values only; the parts that use these things build
them here from it: the worker's communicators (:mod:`lowcomm.train.loop`), its clock
(:mod:`lowcomm.train.compute`) and the launch's pre-flight (:mod:`lowcomm.launch.run`).
"""

from __future__ import annotations

from lowcomm.comm.network import INNER_LINK, OUTER_LINK, NetworkProfile
from lowcomm.config import CommConfig, TrainConfig
from lowcomm.strategies.base import StrategyContext, budget_shares


def network_profile(comm: CommConfig) -> NetworkProfile:
    """The link between workers (``--network``, its overrides and ``--speed-factors``)."""
    return NetworkProfile.from_preset(
        comm.network,
        bandwidth_gbps=comm.bandwidth_gbps,
        latency_ms=comm.latency_ms,
        speed_factors=tuple(comm.speed_factors),
        names=OUTER_LINK,
    )


def replica_network_profile(comm: CommConfig) -> NetworkProfile:
    """The replica link: between the ranks of one worker (``--inner-network``)."""
    return NetworkProfile.from_preset(
        comm.inner_network,
        bandwidth_gbps=comm.inner_bandwidth_gbps,
        latency_ms=comm.inner_latency_ms,
        names=INNER_LINK,
    )


def strategy_context(config: TrainConfig) -> StrategyContext:
    """The settings the strategy receives (without the runtime, which the worker adds): the
    inner optimizer and schedule, the step counts and, with ``--token-budget``, the
    micro-batch budget and each worker's share of it (in proportion to its speed)."""
    budget = (
        None
        if config.run.token_budget is None
        else -(-config.run.token_budget // config.tokens_per_microbatch())
    )
    shares = (
        None
        if budget is None
        else budget_shares(budget, config.comm.speed_factors or (1.0,) * config.placement.workers)
    )
    return StrategyContext(
        optim=config.optim,
        schedule=config.schedule,
        total_steps=config.run.steps,
        microbatches_per_step=config.run.microbatches_per_step,
        max_grad_norm=config.run.max_grad_norm,
        microbatch_budget=budget,
        microbatch_shares=shares,
        seed=config.run.seed,
    )
