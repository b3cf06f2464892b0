"""Re-sharding a checkpoint for another number of workers (an elastic resume).

:func:`reshard` is a pure function from the M per-rank states of a checkpoint (M workers of R
ranks) to the M2 x R2 per-rank states a run with M2 workers of R2 ranks starts from. Every
resumed rank calls it on the old files (:func:`read_resharded`); nothing is written: the
resumed run writes its own checkpoints as usual. The rules, per kind of state:

* **replicated** state (equal on every worker: parameters of synchronous methods, anchors,
  global parameters, outer momentum, settled exchange results, counters) is kept exactly;
* **sharded** state is re-sharded exactly: the optimizer shards of ZeRO-1 and the ACCO family
  (``CostModel.shards_over_workers``) are concatenated and cut for M2 workers, and the AdamW
  moments split over a worker's ranks (``shards_over_replicas``, ZeRO-1 inside a worker) are
  joined and split for R2 ranks;
* **per-worker** state that differs between workers (local parameters, inner optimizer states,
  DES-LOC's unsynchronised moments, local displacements, and float readings such as CoCoDC's
  compensation ratio) is **averaged** (in float64); the next averaging step of every local
  method then sees the same mean it would have seen; an integer or string that differs
  between workers has no rule and the resume is refused naming it;
* **pooled** state (a strategy's ``reshard_pooled`` keys: the ACCO family's accumulated
  gradient sums and their micro-batch counts, which every reduction normalises by their total)
  is summed onto the new worker 0 (zeros elsewhere), so the next reduction is unchanged;
* **remapped** state (a strategy that declares ``reshard_remaps``: decoupled_diloco, whose
  synchronizer and learners name the old learners) is old worker 0's, handed to every new
  worker as it is when the worker count changes, for the strategy's ``load_state_dict`` to
  remap; with the same workers (another R only) each worker keeps its own, its moments
  re-sliced for its new ranks;
* the **data** order continues: the rest of the current pass is dealt to the new workers
  (:func:`lowcomm.data.sampling.consumed_in_pass`), so no sample of it is skipped or repeated;
* **sharded workers** (``--worker-sharding fsdp``): rank r of every worker holds the same FSDP
  slice, so the old ranks r are combined by these rules as one-rank workers would be; with
  the same ranks per worker that is new rank r's state. With another R the R combined slices
  are first joined into the whole model's flat layout (each parameter's rows in order, from
  the shapes the checkpoint records: :func:`lowcomm.train.sharding.fsdp_layout`) and cut
  again into R2 slices, FSDP's way (``ceil(rows / R2)`` rows of every parameter a rank):
  every flat tensor of the method's state and every sharded tensor of the model;
* the **clock** of every new rank starts at the latest old clock (a restart waits for everyone);
  a surviving rank keeps its counters (bytes, tokens), a new one starts them at zero (with
  another ``--ranks-per-worker`` the byte counters start afresh: their levels differ).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lowcomm.config import TrainConfig
from lowcomm.data import DataError
from lowcomm.data.sampling import consumed_in_pass
from lowcomm.train.checkpoint import CheckpointError, read_rank_state

_ADAMW_KEYS = frozenset({"master", "exp_avg", "exp_avg_sq"})
_MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Layout:
    """How a run's processes are arranged: workers, and ranks per worker."""

    workers: int
    ranks_per_worker: int = 1

    @property
    def world_size(self) -> int:
        return self.workers * self.ranks_per_worker

    def __str__(self) -> str:
        extra = "" if self.ranks_per_worker == 1 else f" x {self.ranks_per_worker} ranks"
        return f"{self.workers} workers{extra}"


@dataclass(frozen=True)
class Rules:
    """What a method declares for re-sharding (from its strategy class)."""

    numel: int
    """Parameters in the model (the unpadded length of flat state)."""
    shards_over_workers: bool = False
    shards_over_replicas: bool = False
    pooled: frozenset[str] = frozenset()
    remaps: bool = False


def rules_for(method: str, numel: int) -> Rules:
    """The re-sharding rules of ``method``'s strategy class."""
    from lowcomm.strategies import strategy_class

    cls = strategy_class(method)
    return Rules(
        numel=numel,
        shards_over_workers=cls.cost.shards_over_workers,
        shards_over_replicas=cls.cost.shards_over_replicas,
        pooled=frozenset(cls.reshard_pooled),
        remaps=cls.reshard_remaps,
    )


def saved_layout(directory: Path) -> Layout:
    """The layout a checkpoint was written with (from its manifest)."""
    manifest = json.loads((directory / "manifest.json").read_text())
    ranks = int(manifest.get("fingerprint", {}).get("ranks_per_worker", 1))
    return Layout(int(manifest["world_size"]) // ranks, ranks)


def read_resharded(
    directory: Path, config: TrainConfig, rank: int, device: torch.device
) -> dict[str, Any]:
    """This rank's state from the checkpoint in ``directory``, re-sharded when it was written
    with another layout (nothing is written).

    Re-sharding needs every old rank's state, and every resumed rank re-shards. The old files
    are mapped, not read: the node's page cache holds one copy of each, shared by all its
    ranks (and worker threads), where reading them put a private copy of the whole run in
    every rank's memory (8 per 8-GPU node) and read each file once per rank. Only what this
    rank keeps is copied (:func:`reshard` leaves its inputs untouched, so no page is
    written)."""
    old, new = (
        saved_layout(directory),
        Layout(config.placement.workers, config.placement.ranks_per_worker),
    )
    if old == new:
        return read_rank_state(directory, rank, device)
    states = [read_rank_state(directory, r, "cpu", mmap=True) for r in range(old.world_size)]
    # (Sharded workers: rank 0 holds a whole FSDP chunk of every parameter, the length of
    # every rank's flat buffer.)
    rules = rules_for(config.method, parameter_count(states[0]))
    sharded = config.placement.worker_sharding == "fsdp"
    mine = reshard(states, old, new, rules, sharded_workers=sharded)[rank]
    moved: dict[str, Any] = _to_device(mine, device)
    return moved


def parameter_count(state: dict[str, Any]) -> int:
    """Parameters of the model in a rank state (tied weights counted once)."""
    seen = {
        (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        for t in state["model"].values()
        if t.is_floating_point()
    }
    return sum(numel for _, _, numel in seen)


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {key: _to_device(item, device) for key, item in value.items()}
    if isinstance(value, list):
        return [_to_device(item, device) for item in value]
    return value


def reshard(
    states: list[dict[str, Any]],
    old: Layout,
    new: Layout,
    rules: Rules,
    *,
    sharded_workers: bool = False,
) -> list[dict[str, Any]]:
    """The per-rank states of ``new`` from the per-rank ``states`` of ``old`` (see the module
    docstring for the rules). A pure function: ``states`` is not modified.

    ``sharded_workers`` (``--worker-sharding fsdp``): rank r of every worker holds the same
    FSDP slice of every parameter and of the method's state, so the old ranks r are combined
    as the flat workers of a one-rank layout would be, into the new ranks r, or (another R)
    joined whole and cut again for the new ranks.

    Raises:
        CheckpointError: the states cannot be combined (naming the key), or are not ``old``'s.
    """
    _check_count(states, old)
    ranks = old.ranks_per_worker
    slots = (
        [_merged(states[r::ranks], Layout(old.workers), new.workers, rules) for r in range(ranks)]
        if sharded_workers
        else [_merged(states, old, new.workers, rules)]
    )
    if sharded_workers and new.ranks_per_worker != ranks:
        slots, rules = _recut(slots, states[0], new, rules)
    # (A method that remaps its state keeps each worker's own when only R changes.)
    own = rules.remaps and not sharded_workers and new.workers == old.workers
    kept = [_join_replicas(states, old, w) for w in range(old.workers)] if own else None
    try:
        carry = consumed_in_pass([s["data"] for s in states]).state()
    except DataError as error:
        raise CheckpointError(f"--resume: cannot continue the data order: {error}") from None
    latest = max(float(s["clock"]["now"]) for s in states)
    out = []
    for rank in range(new.world_size):
        worker, replica = divmod(rank, new.ranks_per_worker)
        state = {
            key: value for key, value in states[0].items() if key in ("format", "val_loss", "step")
        }
        state["model"], state["strategy"] = _rank_state(
            slots, kept, new, worker, replica, rules, sharded_workers=sharded_workers
        )
        state["data"] = {
            **{k: v for k, v in states[0]["data"].items() if not k.startswith("carry")},
            **carry, "position": 0, "rank": worker, "world_size": new.workers,
            "replica": replica, "replicas": new.ranks_per_worker,
        }  # fmt: skip
        state.update(_counters(states, old, new, rank, latest))
        state["membership"] = {
            "step": int(states[0]["step"]), "old_workers": old.workers,
            "new_workers": new.workers, "old_ranks_per_worker": old.ranks_per_worker,
            "new_ranks_per_worker": new.ranks_per_worker,
        }  # fmt: skip
        out.append(state)
    return out


def _rank_state(
    slots: list[tuple[Any, Any]],
    kept: list[dict[str, Any]] | None,
    new: Layout,
    worker: int,
    replica: int,
    rules: Rules,
    *,
    sharded_workers: bool,
) -> tuple[Any, Any]:
    """(model, strategy) state of new rank (``worker``, ``replica``): its slot's, split for it
    (``kept``: each old worker's own state, which a remapping method keeps when only the ranks
    per worker change)."""
    if sharded_workers:  # this rank's slot, split as a one-rank worker's
        model, strategy = slots[replica]
        return model, _split(strategy, Layout(new.workers), worker, 0, rules)
    model, strategy = (
        slots[0] if kept is None else (kept[worker]["model"], kept[worker]["strategy"])
    )
    return model, _split(strategy, new, worker, replica, rules)


def _check_count(states: list[dict[str, Any]], old: Layout) -> None:
    """Refuse a number of rank states that is not ``old``'s."""
    if len(states) != old.world_size:
        raise CheckpointError(
            f"--resume: {len(states)} rank states for {old} ({old.world_size} processes)"
        )


# --- sharded workers: FSDP slices re-cut for another --ranks-per-worker ----------------------


@dataclass(frozen=True)
class FsdpCut:
    """How FSDP cuts a worker's parameters over ``ranks`` ranks (``shapes``: each trained
    parameter's global shape, in flat-buffer order): dim 0 in chunks of ``ceil(rows / R)``
    rows, chunk r on rank r, each rank's flat buffer the padded chunks end to end."""

    shapes: tuple[tuple[int, ...], ...]
    ranks: int

    def chunk_rows(self, shape: tuple[int, ...]) -> int:
        return -(-shape[0] // self.ranks) if shape else 1

    @property
    def offsets(self) -> list[int]:
        """Where each parameter starts in a rank's flat buffer, and (last) its length."""
        out = [0]
        for shape in self.shapes:
            out.append(out[-1] + self.chunk_rows(shape) * math.prod(shape[1:]))
        return out

    @property
    def local_numel(self) -> int:
        """A rank's flat length (every rank's, padding included)."""
        return self.offsets[-1]

    @property
    def whole_numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """(local start, whole start, elements) of each parameter's slice on ``rank``."""
        out, whole = [], 0
        for shape, local in zip(self.shapes, self.offsets, strict=False):
            rows, row = (shape[0], math.prod(shape[1:])) if shape else (1, 1)
            chunk = self.chunk_rows(shape)
            first = min(rank * chunk, rows)
            out.append((local, whole + first * row, min(chunk, rows - first) * row))
            whole += rows * row
        return out

    def join(self, slices: list[torch.Tensor]) -> torch.Tensor:
        """The whole flat tensor from every rank's flat slice (their padding dropped)."""
        whole = torch.zeros(self.whole_numel, dtype=slices[0].dtype)
        for rank, part in enumerate(slices):
            for local, start, numel in self.pieces(rank):
                whole[start : start + numel] = part[local : local + numel]
        return whole

    def cut(self, whole: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s flat slice of the whole flat tensor (zeros in its padding)."""
        part = torch.zeros(self.local_numel, dtype=whole.dtype)
        for local, start, numel in self.pieces(rank):
            part[local : local + numel] = whole[start : start + numel]
        return part


#: A run of whole parameters in a rank's flat buffer: (first parameter, one past the last).
Segment = tuple[int, int]


class _Recutter:
    """Re-cuts one worker's method state from ``old`` ranks' slices to ``new``'s: a flat
    tensor (padded at most for the new worker count), ``k`` flat tensors end to end (CO2's
    buffer), a list whose tensors are consecutive runs of whole parameters (Streaming
    DiLoCo's fragments, and their outer optimizers' buffers) and the tensors of an exchange
    of one of those fragments; every other tensor must be the same on the worker's ranks,
    and is kept."""

    def __init__(self, old: FsdpCut, new: FsdpCut, new_workers: int) -> None:
        self.old, self.new, self.new_workers = old, new, new_workers
        self.old_offsets, self.new_offsets = old.offsets, new.offsets
        self.fragments: list[Segment] | None = None

    def state(self, trees: list[Any]) -> list[Any]:
        """Every new rank's method state from the old ranks'; an exchange in flight for
        fragment ``i`` (a dict with ``"fragment": i``) holds that fragment's run."""
        self.fragments = self._find_fragments(trees[0])
        return self.tree(trees)

    def _find_fragments(self, tree: Any) -> list[Segment] | None:
        if isinstance(tree, dict):
            tree = list(tree.values())
        if isinstance(tree, list | tuple):
            found = self._fragments(tree)
            for item in tree:
                found = found or self._find_fragments(item)
            return found
        return None

    def tree(self, trees: list[Any], segment: Segment | None = None) -> list[Any]:
        """Every new rank's tree from the old ranks' ``trees`` (same structure)."""
        first = trees[0]
        ranks = self.new.ranks
        if isinstance(first, dict):
            fragment = first.get("fragment")
            if isinstance(fragment, int) and self.fragments and 0 <= fragment < len(self.fragments):
                segment = self.fragments[fragment]
            per_key = {k: self.tree([t[k] for t in trees], segment) for k in first}
            return [{k: per_key[k][r] for k in first} for r in range(ranks)]
        if isinstance(first, list | tuple):
            segments = self._fragments(first) if segment is None else None
            items = [
                self.tree([t[i] for t in trees], None if segments is None else segments[i])
                for i in range(len(first))
            ]
            return [[item[r] for item in items] for r in range(ranks)]
        if isinstance(first, torch.Tensor) and first.dim() == 1 and first.numel() > 0:
            cut = self._cut(trees, segment)
            if cut is not None:
                return cut
        differs = isinstance(first, torch.Tensor) and first.dim() > 0
        if differs and any(not _equal(first, t) for t in trees[1:]):
            raise CheckpointError(
                f"--ranks-per-worker: a tensor of shape {tuple(first.shape)} in the method's "
                f"state differs between a worker's ranks and is not a slice of its "
                f"parameters; resume with --ranks-per-worker {self.old.ranks}"
            )
        return [first] * ranks

    def _cut(self, parts: list[torch.Tensor], segment: Segment | None) -> list[Any] | None:
        numel, local = parts[0].numel(), self.old.local_numel
        if segment is not None:
            begin, end = self.old_offsets[segment[0]], self.old_offsets[segment[1]]
            if numel != end - begin:
                return None
            flats = []
            for part in parts:
                flat = torch.zeros(local, dtype=part.dtype)
                flat[begin:end] = part
                flats.append(flat)
            whole = self.old.join(flats)
            begin, end = self.new_offsets[segment[0]], self.new_offsets[segment[1]]
            return [self.new.cut(whole, r)[begin:end] for r in range(self.new.ranks)]
        if local <= numel < local + self.new_workers:  # a flat buffer
            whole = self.old.join([p[:local] for p in parts])
            return [self.new.cut(whole, r) for r in range(self.new.ranks)]
        if numel % local == 0:  # flat buffers end to end
            wholes = [self.old.join([p[k * local : (k + 1) * local] for p in parts])
                      for k in range(numel // local)]  # fmt: skip
            return [torch.cat([self.new.cut(w, r) for w in wholes]) for r in range(self.new.ranks)]
        return None

    def _fragments(self, items: list[Any] | tuple[Any, ...]) -> list[Segment] | None:
        """Each item's run of parameters when the items' lengths (a tensor's, or the one
        length of a dict's tensors) tile the flat buffer at parameter boundaries, else None."""
        lengths = [_one_length(item) for item in items]
        if len(items) < 2 or None in lengths or sum(lengths) != self.old.local_numel:  # type: ignore[arg-type]
            return None
        index = {offset: i for i, offset in enumerate(self.old_offsets)}
        segments, begin = [], 0
        for length in lengths:
            assert length is not None
            if begin not in index or begin + length not in index:
                return None
            segments.append((index[begin], index[begin + length]))
            begin += length
        return segments


def _one_length(item: Any) -> int | None:
    """A 1-D tensor's length, or the one length of every 1-D tensor of a dict (None else)."""
    if isinstance(item, torch.Tensor):
        return item.numel() if item.dim() == 1 else None
    if isinstance(item, dict):
        lengths = {v.numel() for v in item.values() if isinstance(v, torch.Tensor) and v.dim() == 1}
        return lengths.pop() if len(lengths) == 1 else None
    return None


def _recut(
    slots: list[tuple[Any, Any]], first: dict[str, Any], new: Layout, rules: Rules
) -> tuple[list[tuple[Any, Any]], Rules]:
    """The (model, strategy) slots of R ranks cut again for ``new.ranks_per_worker`` (see the
    module docstring), and the rules with the new slices' flat length."""
    layout = first.get("fsdp_layout")
    if not isinstance(layout, dict):
        raise CheckpointError(
            "--ranks-per-worker: this checkpoint of sharded workers does not record its FSDP "
            "layout (written by an older lowcomm), so its slices cannot be re-cut; resume with "
            "the --ranks-per-worker it was written with (--workers may change)"
        )
    shapes = tuple(tuple(int(d) for d in shape) for shape in layout["flat"])
    old = FsdpCut(shapes, len(slots))
    cut = FsdpCut(shapes, new.ranks_per_worker)
    if old.local_numel != rules.numel:
        raise CheckpointError(
            f"--resume: the checkpoint's FSDP layout ({old.local_numel} elements a rank) does "
            f"not match its flat state ({rules.numel}); the checkpoint is inconsistent"
        )
    sharded = {name: tuple(int(d) for d in shape) for name, shape in layout["sharded"].items()}

    def recut_model(models: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        out: list[dict[str, torch.Tensor]] = [{} for _ in range(cut.ranks)]
        for name, value in models[0].items():
            shape = sharded.get(name)
            if shape is None:  # (a buffer: whole on every rank)
                for state in out:
                    state[name] = value
                continue
            whole = torch.cat([m[name] for m in models])
            rows = FsdpCut((shape,), cut.ranks).chunk_rows(shape)
            for rank, state in enumerate(out):
                state[name] = whole[rank * rows : (rank + 1) * rows].clone()
        return out

    strategies = _Recutter(old, cut, new.workers).state([strategy for _, strategy in slots])
    if rules.shards_over_workers:  # flat buffers padded to a multiple of the worker count
        strategies = [_repad(s, cut.local_numel, 1, new.workers) for s in strategies]
    models = recut_model([model for model, _ in slots])
    return list(zip(models, strategies, strict=True)), Rules(
        numel=cut.local_numel, shards_over_workers=rules.shards_over_workers,
        shards_over_replicas=rules.shards_over_replicas, pooled=rules.pooled,
        remaps=rules.remaps,
    )  # fmt: skip


def _merged(
    states: list[dict[str, Any]], old: Layout, new_workers: int, rules: Rules
) -> tuple[Any, Any]:
    """(model, strategy) state of the old workers combined by the module's rules (the
    strategy's padded for ``new_workers`` when sharded over the workers)."""
    workers = [_join_replicas(states, old, w) for w in range(old.workers)]
    if rules.remaps:
        strategy = workers[0]["strategy"]  # (remapped by the strategy as it loads it)
    else:
        strategy = _combine([w["strategy"] for w in workers], "strategy", rules, sharded=True)
    if rules.shards_over_workers:  # flat buffers padded to a multiple of the worker count
        strategy = _repad(strategy, rules.numel, old.workers, new_workers)
    model = _combine([w["model"] for w in workers], "model", rules, sharded=False)
    return model, strategy


def _counters(
    states: list[dict[str, Any]], old: Layout, new: Layout, rank: int, latest: float
) -> dict[str, Any]:
    """Clock, comm counters, tokens and random state of new ``rank``."""
    survivor = rank < old.world_size
    own = states[rank] if survivor else states[0]
    clock = {
        key: (value if survivor else 0.0) if isinstance(value, float) else value
        for key, value in own["clock"].items()
    }
    clock["now"] = latest
    comm: Any = None
    if old.ranks_per_worker == new.ranks_per_worker:
        comm = own["comm"] if survivor else _zeroed(own["comm"])
    return {
        "clock": clock,
        "comm": comm,
        "rng": states[rank % old.world_size]["rng"],
        "tokens": int(own["tokens"]) if survivor else 0,
    }


def _zeroed(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _zeroed(item) for key, item in value.items()}
    if isinstance(value, bool | str):
        return value
    if isinstance(value, int | float):
        return type(value)(0)
    return value


def _is_adamw(value: Any) -> bool:
    return isinstance(value, dict) and set(value) >= _ADAMW_KEYS


def _join_replicas(states: list[dict[str, Any]], old: Layout, worker: int) -> dict[str, Any]:
    """One worker's state: its first rank's, with moments split over its ranks joined."""
    ranks = states[worker * old.ranks_per_worker : (worker + 1) * old.ranks_per_worker]
    if len(ranks) == 1:
        return ranks[0]
    return {**ranks[0], "strategy": _map_adamw([r["strategy"] for r in ranks], _join_moments)}


def _join_moments(parts: list[dict[str, Any]]) -> dict[str, Any]:
    master = parts[0]["master"]
    if parts[0]["exp_avg"].numel() == master.numel():
        return parts[0]
    joined = {name: torch.cat([p[name] for p in parts]) for name in _MOMENTS}
    return {**parts[0], **joined}


def _map_adamw(trees: list[Any], apply: Callable[[list[dict[str, Any]]], dict[str, Any]]) -> Any:
    """``trees`` (same structure) with every AdamW state dict replaced by ``apply`` of the
    corresponding dicts of all trees (the other leaves: the first tree's)."""
    first = trees[0]
    if _is_adamw(first):
        return apply(trees)
    if isinstance(first, dict):
        return {key: _map_adamw([t[key] for t in trees], apply) for key in first}
    if isinstance(first, list):
        return [_map_adamw([t[i] for t in trees], apply) for i in range(len(first))]
    return first


def _combine(values: list[Any], path: str, rules: Rules, *, sharded: bool) -> Any:
    """One state from the workers' ``values`` (same structure) by the module's rules."""
    first = values[0]
    name = path.rsplit(".", 1)[-1]
    if isinstance(first, dict):
        if any(set(v) != set(first) for v in values):
            raise CheckpointError(f"--resume: cannot re-shard {path}: workers hold other keys")
        worker_shards = sharded and rules.shards_over_workers and _is_adamw(first)
        return {
            key: _concat([v[key] for v in values], rules.numel)
            if worker_shards and key in _ADAMW_KEYS
            else _combine([v[key] for v in values], f"{path}.{key}", rules, sharded=sharded)
            for key in first
        }
    if isinstance(first, list | tuple):
        return [
            _combine([v[i] for v in values], f"{path}[{i}]", rules, sharded=sharded)
            for i in range(len(first))
        ]
    if sharded and name in rules.pooled:
        return sum(values[1:], start=first)
    if all(_equal(first, v) for v in values[1:]):
        return first
    if isinstance(first, torch.Tensor) and first.is_floating_point():
        mean = torch.stack([v.double() for v in values]).mean(dim=0)
        return mean.to(first.dtype)
    if isinstance(first, float):
        return sum(float(v) for v in values) / len(values)
    raise CheckpointError(
        f"--resume: cannot re-shard {path}: the workers hold different values "
        f"({values[0]!r} and others) that have no combining rule; resume with the old --workers"
    )


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    return bool(a == b)


def _repad(tree: Any, numel: int, old: int, new: int) -> Any:
    """``tree`` with every flat buffer padded for ``old`` workers (1-D, ``numel`` plus fewer
    than ``old`` zeros) padded for ``new`` instead (``FlatBuffers(pad_to=new)``)."""
    if isinstance(tree, dict):
        return {key: _repad(value, numel, old, new) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_repad(value, numel, old, new) for value in tree]
    if isinstance(tree, torch.Tensor) and tree.dim() == 1 and numel <= tree.numel() < numel + old:
        padded = torch.zeros(-(-numel // new) * new, dtype=tree.dtype)
        padded[:numel] = tree[:numel]
        return padded
    return tree


def _concat(shards: list[torch.Tensor], numel: int) -> torch.Tensor:
    """The whole (unpadded) tensor from equal worker shards; scalars are kept."""
    if shards[0].dim() == 0:
        return shards[0]
    return torch.cat(shards)[:numel]


def _split(tree: Any, new: Layout, worker: int, replica: int, rules: Rules) -> Any:
    """New (worker, replica)'s strategy state from the combined one."""
    if isinstance(tree, dict):
        if rules.shards_over_workers and _is_adamw(tree):
            return {k: _cut(v, new.workers, worker, rules.numel) for k, v in tree.items()}
        if rules.shards_over_replicas and new.ranks_per_worker > 1 and _is_adamw(tree):
            return {**tree, **_replica_slice(tree, new.ranks_per_worker, replica)}
        return {k: _split_leaf(k, v, new, worker, replica, rules) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_split(item, new, worker, replica, rules) for item in tree]
    return tree


def _split_leaf(key: str, value: Any, new: Layout, worker: int, replica: int, rules: Rules) -> Any:
    if key in rules.pooled and worker != 0:
        return torch.zeros_like(value) if isinstance(value, torch.Tensor) else type(value)(0)
    return _split(value, new, worker, replica, rules)


def _cut(value: Any, parts: int, index: int, numel: int) -> Any:
    """Part ``index`` of ``parts`` equal parts of ``value`` zero-padded to a multiple of
    ``parts`` (ZeRO-1's layout, :class:`lowcomm.strategies.flat.FlatBuffers`)."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    padded = torch.zeros(-(-numel // parts) * parts, dtype=value.dtype)
    padded[:numel] = value[:numel]
    size = padded.numel() // parts
    return padded[index * size : (index + 1) * size].clone()


def _replica_slice(tree: dict[str, Any], replicas: int, replica: int) -> dict[str, Any]:
    """Replica ``replica``'s slice of the moments (``ReplicaShardedAdamW``'s layout)."""
    numel = tree["master"].numel()
    size = -(-numel // replicas)
    begin = min(replica * size, numel)
    end = min(begin + size, numel)
    return {name: tree[name][begin:end].clone() for name in _MOMENTS}
