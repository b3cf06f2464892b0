"""Which methods run on sharded workers (``--worker-sharding``), from their declarations.

Below :mod:`lowcomm.config`, which validates the option with it, and below
:mod:`lowcomm.train.sharding`, which shards the workers: the configuration does not import the
training code to check itself.
"""

from __future__ import annotations

#: The values of --worker-sharding.
SHARDINGS = ("replicate", "fsdp")


def sharded_methods() -> tuple[str, ...]:
    """The methods that run on sharded workers (their ``sharding_refusal`` is None); every
    other one is refused with its reason."""
    from lowcomm.strategies import STRATEGIES

    return tuple(sorted(n for n, cls in STRATEGIES.items() if cls.sharding_refusal is None))


def sharding_refusal(method: str, sharding: str, ranks_per_worker: int) -> str | None:
    """Why ``--method method --worker-sharding sharding`` cannot run, in one line, or None."""
    if sharding not in SHARDINGS:
        return (
            f"--worker-sharding: {sharding!r} is not one of {', '.join(SHARDINGS)}; pass "
            f"replicate (every rank holds the whole replica) or fsdp"
        )
    if sharding == "replicate":
        return None
    from lowcomm.strategies import strategy_class

    reason = strategy_class(method).sharding_refusal
    if reason is not None:
        return (
            f"--worker-sharding fsdp: --method {method} does not run on sharded workers: "
            f"{reason}; use --worker-sharding replicate"
        )
    if ranks_per_worker < 2:
        return (
            f"--worker-sharding fsdp: --ranks-per-worker {ranks_per_worker} leaves nothing to "
            f"shard; pass --ranks-per-worker 2 or more"
        )
    return None


__all__ = ["SHARDINGS", "sharded_methods", "sharding_refusal"]
