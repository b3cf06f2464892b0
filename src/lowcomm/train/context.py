"""What a run builds from its configuration for its strategy and its links.

:class:`~lowcomm.config.TrainConfig` holds values only; the parts that use these things build
them here from it: the worker's communicators (:mod:`lowcomm.train.loop`), its clock
(:mod:`lowcomm.train.compute`) and the launch's pre-flight (:mod:`lowcomm.launch.run`).
"""

from __future__ import annotations

from lowcomm.comm.network import INNER_LINK, OUTER_LINK, NetworkProfile
from lowcomm.config import TrainConfig
from lowcomm.strategies.base import StrategyContext, budget_shares


def network_profile(config: TrainConfig) -> NetworkProfile:
    """The link between workers (``--network``, its overrides and ``--speed-factors``)."""
    return NetworkProfile.from_preset(
        config.network,
        bandwidth_gbps=config.bandwidth_gbps,
        latency_ms=config.latency_ms,
        speed_factors=tuple(config.speed_factors),
        names=OUTER_LINK,
    )


def replica_network_profile(config: TrainConfig) -> NetworkProfile:
    """The replica link: between the ranks of one worker (``--inner-network``)."""
    return NetworkProfile.from_preset(
        config.inner_network,
        bandwidth_gbps=config.inner_bandwidth_gbps,
        latency_ms=config.inner_latency_ms,
        names=INNER_LINK,
    )


def strategy_context(config: TrainConfig) -> StrategyContext:
    """The settings the strategy receives (without the runtime, which the worker adds): the
    inner optimizer and schedule, the step counts and, with ``--token-budget``, the
    micro-batch budget and each worker's share of it (in proportion to its speed)."""
    budget = (
        None
        if config.token_budget is None
        else -(-config.token_budget // config.tokens_per_microbatch())
    )
    shares = (
        None
        if budget is None
        else budget_shares(budget, config.speed_factors or (1.0,) * config.workers)
    )
    return StrategyContext(
        optim=config.optim,
        schedule=config.schedule,
        total_steps=config.steps,
        microbatches_per_step=config.microbatches_per_step,
        max_grad_norm=config.max_grad_norm,
        microbatch_budget=budget,
        microbatch_shares=shares,
        seed=config.seed,
    )
