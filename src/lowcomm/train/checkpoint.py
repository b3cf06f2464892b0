"""Checkpoints: atomic, checksummed, loaded without unpickling arbitrary objects.

Layout under a run directory::

    checkpoints/
      step-000040/rank0.pt ... rankN.pt   one file per worker (torch.save of plain containers)
      step-000040/manifest.json           written last: step, world size, method, sha256 per file
      latest                              name of the newest complete checkpoint

A checkpoint exists only once its manifest does, and ``latest`` moves only after that, so a
run killed mid-write leaves the previous checkpoint intact. A resume takes the newest intact
checkpoint: a newer one that is incomplete, truncated or corrupted is passed over (and named). Every file is written to a
temporary name, flushed, fsynced and renamed. Loading verifies the checksum and uses
``torch.load(weights_only=True)``, which refuses anything but tensors and plain containers.

No rank reads another rank's file, so the nodes of a run need not share a file system: each
rank checksums the file it wrote, the checksums are gathered over the bookkeeping group, and
every rank writes the same manifest (and ``latest``) into its own view of the run directory. A
resume verifies each rank's own file, and the ranks agree on the newest checkpoint intact for
all of them (:func:`agree_latest`). Only a resume with another layout (``--workers``,
``--ranks-per-worker``: ``train/reshard.py``) reads every old file, so it needs them all.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import torch

from lowcomm.atomic import atomic_path, atomic_write_bytes
from lowcomm.comm.base import Comm, Role
from lowcomm.config import TrainConfig
from lowcomm.data import END_OF_TEXT

#: Version of the checkpoint layout. 2: every family's inner optimizer saves the one flat-optimizer
#: state dict (co2's and DES-LOC's states changed shape), and in-flight exchanges save how they
#: were settled.
FORMAT_VERSION = 2


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupted or from another configuration."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


#: Fingerprint keys added after format 2 was released, with the value a checkpoint that
#: predates them was necessarily written with.
_ADDED_LATER: dict[str, Any] = {
    "precision": "fp32",
    "comm_dtype": "fp32",
    "worker_sharding": "replicate",
    "faults": None,
}


#: How a fingerprint names a given tokenizer: by its content, so a run resumes with the same
#: tokenizer.json read from another place (the run directory's copy, a moved source).
_TOKENIZER_DIGEST = "sha256:"


def tokenizer_identity(path: str | None) -> str | None:
    """A --tokenizer file's identity in a fingerprint: ``sha256:<hex>`` of its bytes (its
    path as given where it cannot be read; pre-flight names that problem)."""
    if path is None:
        return None
    try:
        return _TOKENIZER_DIGEST + _sha256(Path(path).expanduser())
    except OSError:
        return path


def _model_identity(config: TrainConfig) -> dict[str, Any]:
    """The model options in a fingerprint: unset ones as their from-scratch defaults (the
    values checkpoints from before they could be unset carry), the options only some
    families have only when set, and a --model.config file by its content."""
    from lowcomm.models import DEFAULTS, HF_ONLY

    model = dataclasses.asdict(config.model)
    if model["config"] is not None:  # the architecture is the file's
        model["config"] = tokenizer_identity(model["config"])
    else:
        for name, default in DEFAULTS.items():
            if model.get(name) is None and name not in HF_ONLY:
                model[name] = default
    return {key: value for key, value in model.items() if value is not None}


def fingerprint(config: TrainConfig) -> dict[str, Any]:
    """The settings a checkpoint's state depends on: resuming under different ones would not
    continue the same run (JSON-normalised so it compares equal after a round trip). A given
    tokenizer is named by its content (:func:`tokenizer_identity`), not its path."""
    from lowcomm.faults.run import faults_identity
    from lowcomm.strategies import strategy_class

    options_field = strategy_class(config.method).options_field
    chosen = {
        "method": config.method,
        "ranks_per_worker": config.placement.ranks_per_worker,
        "worker_sharding": config.placement.worker_sharding,
        "seed": config.run.seed,
        "steps": config.run.steps,
        "microbatches_per_step": config.run.microbatches_per_step,
        "max_grad_norm": config.run.max_grad_norm,
        "clock": config.comm.clock,
        "precision": config.numerics.precision,
        "comm_dtype": config.comm.comm_dtype,
        "model": _model_identity(config),
        # (--tokenizer only when given, --end-of-text only when not <|endoftext|>: checkpoints
        # from before they existed still match.)
        "data": {
            key: tokenizer_identity(value) if key == "tokenizer" else value
            for key, value in dataclasses.asdict(config.data).items()
            if not (key == "tokenizer" and value is None)
            and not (key == "end_of_text" and value in (None, END_OF_TEXT))
        },
        # (--optim.name and Muon's settings only with muon: checkpoints from before Muon
        # existed still match.)
        "optim": {
            key: value
            for key, value in dataclasses.asdict(config.optim).items()
            if config.optim.name == "muon" or not (key == "name" or key.startswith("muon_"))
        },
        "schedule": dataclasses.asdict(config.schedule),
        "options": None
        if options_field is None
        else dataclasses.asdict(getattr(config, options_field)),
        # The fault trace (by content) the saved cursor and quorum belong to (None: none).
        "faults": faults_identity(config),
    }
    normalised: dict[str, Any] = json.loads(json.dumps(chosen, default=str))
    return normalised


def has_checkpoint(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a committed checkpoint (intact or not)."""
    return (run_dir / "checkpoints" / "latest").exists() or bool(committed(run_dir))


def committed(run_dir: Path) -> list[Path]:
    """The checkpoint (step-*) directories with a manifest, oldest first."""
    return sorted(
        p for p in (run_dir / "checkpoints").glob("step-*") if (p / "manifest.json").exists()
    )


def step_directory(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step:06d}"


def write_rank_state(run_dir: Path, step: int, rank: int, state: dict[str, Any]) -> Path:
    """Write one worker's state for ``step`` (atomically); return its path."""
    directory = step_directory(run_dir, step)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rank{rank}.pt"
    with atomic_path(path) as temporary:
        torch.save({"format": FORMAT_VERSION, **state}, temporary)
    return path


def file_digest(path: Path) -> str:
    """The sha256 (hex) of the file at ``path``: a rank's checksum of the file it wrote."""
    return _sha256(path)


#: Bytes of a sha256 digest.
_DIGEST_BYTES = 32


def gather_digests(bookkeeping: Comm, digest: str) -> list[str]:
    """Every rank's checksum of its own file, in rank order (a collective over
    ``bookkeeping``): what the manifest lists, without any rank reading another's file."""
    mine = torch.tensor(list(bytes.fromhex(digest)), dtype=torch.int64)
    everyone = torch.zeros(bookkeeping.world_size * _DIGEST_BYTES, dtype=torch.int64)
    bookkeeping.all_gather(everyone, mine, role=Role.OTHER).wait()
    rows = everyone.view(bookkeeping.world_size, _DIGEST_BYTES).tolist()
    return [bytes(row).hex() for row in rows]


def commit_checkpoint(
    run_dir: Path,
    step: int,
    world_size: int,
    fingerprint: dict[str, Any],
    keep: int = 2,
    digests: Sequence[str] | None = None,
) -> None:
    """After every rank wrote its file: write the manifest, move ``latest``, then drop
    checkpoints older than the newest ``keep``.

    ``digests``: every rank's checksum of its own file (:func:`gather_digests`); every rank
    then commits into its own view of ``run_dir`` (the same bytes, written atomically, so ranks
    that share a disk may race harmlessly), and no file of another rank is read. Without them
    (one process holding every file), the files are hashed here."""
    directory = step_directory(run_dir, step)
    if digests is None:
        digests = [_sha256(directory / f"rank{rank}.pt") for rank in range(world_size)]
    if len(digests) != world_size:
        raise ValueError(f"{len(digests)} checksums for a checkpoint of {world_size} ranks")
    manifest = {
        "format": FORMAT_VERSION,
        "step": step,
        "world_size": world_size,
        "fingerprint": fingerprint,
        "sha256": {f"rank{rank}.pt": digest for rank, digest in enumerate(digests)},
    }
    atomic_write_bytes(
        directory / "manifest.json", (json.dumps(manifest, indent=2) + "\n").encode()
    )
    atomic_write_bytes(run_dir / "checkpoints" / "latest", (directory.name + "\n").encode())
    complete = committed(run_dir)
    # After a resume from an older checkpoint (the newer ones were not intact), those newer
    # ones belong to the abandoned continuation: drop them, then keep the newest `keep`.
    for newer in (p for p in complete if p.name > directory.name):
        shutil.rmtree(newer, ignore_errors=True)
    complete = [p for p in complete if p.name <= directory.name]
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def preflight_ranks(per_process: int = 1) -> tuple[int, ...] | None:
    """The ranks whose checkpoint files this process's pre-flight may verify: under
    ``torchrun`` its own workers' (``per_process`` of them from ``RANK x per_process``;
    another node's files need not be on this disk), else all (None)."""
    from lowcomm.prestart import under_torchrun

    if not under_torchrun() or "RANK" not in os.environ:
        return None
    first = int(os.environ["RANK"]) * per_process
    return tuple(range(first, first + per_process))


@dataclasses.dataclass(frozen=True)
class Resumable:
    """The checkpoint a resume loads, and the newer ones passed over (with why)."""

    step: int
    directory: Path
    skipped: tuple[str, ...] = ()

    def fallback_note(self) -> str | None:
        """One line saying which checkpoint is used and why, when it is not the newest."""
        if not self.skipped:
            return None
        return (
            f"lowcomm: resuming from {self.directory.name} (step {self.step}), the newest intact "
            f"checkpoint: {'; '.join(self.skipped)}"
        )


def find_latest(
    run_dir: Path,
    world_size: int,
    fingerprint: dict[str, Any],
    ranks: Collection[int] | None = None,
) -> tuple[int, Path]:
    """The newest intact checkpoint of ``run_dir``; returns (step, directory).

    Raises:
        CheckpointError: naming what is wrong and what to do.
    """
    found = find_resumable(run_dir, world_size, fingerprint, ranks)
    return found.step, found.directory


def _candidates(run_dir: Path) -> tuple[list[Path], list[str]]:
    """The committed checkpoint directories (those with a manifest, and the one
    ``checkpoints/latest`` names), newest first, and what was wrong with ``latest``."""
    root = run_dir / "checkpoints"
    pointer = root / "latest"
    candidates = set(committed(run_dir))
    skipped: list[str] = []
    if pointer.exists():
        try:
            named = pointer.read_text().strip()
        except (OSError, UnicodeDecodeError) as error:
            named = ""
            skipped.append(f"checkpoints/latest is unreadable ({error})")
        if named:
            # What `latest` names is tried even without a manifest (and then reported).
            candidates.add(root / named)
    # Newest first. (A checkpoint can be newer than `latest`: a run stopped between writing
    # its manifest and moving `latest` left it complete.)
    return sorted(candidates, key=lambda p: p.name, reverse=True), skipped


def find_resumable(
    run_dir: Path,
    world_size: int,
    fingerprint: dict[str, Any],
    ranks: Collection[int] | None = None,
) -> Resumable:
    """The newest intact checkpoint of ``run_dir``, verified, and the newer ones it passes over.

    The committed checkpoints are tried newest first: one that is incomplete, truncated or
    corrupted is passed over for the next older one kept (``--keep-checkpoints``). A
    checkpoint of another configuration or world size is not damage: that fails at once.
    ``ranks``: whose files to verify (None: all; a rank verifies only its own, which is all
    its disk need hold).

    Raises:
        CheckpointError: naming what is wrong and what to do.
    """
    candidates_newest_first, skipped = _candidates(run_dir)
    if not candidates_newest_first:
        raise CheckpointError(
            f"--resume: {run_dir} has no checkpoint (no checkpoints/latest); train with "
            f"--checkpoint-every N to write them"
        )
    for directory in candidates_newest_first:
        problem = _damage(directory, world_size, fingerprint, ranks)
        if problem is None:
            manifest = json.loads((directory / "manifest.json").read_text())
            return Resumable(int(manifest["step"]), directory, tuple(skipped))
        skipped.append(f"{directory.name} {problem}")
    raise CheckpointError(
        f"--resume: no intact checkpoint in {run_dir / 'checkpoints'}: {'; '.join(skipped)}; "
        f"start afresh (--overwrite) or restore a copy"
    )


def _intact(
    run_dir: Path, world_size: int, fingerprint: dict[str, Any], rank: int
) -> tuple[dict[int, Path], list[str]]:
    """The checkpoints whose file of ``rank`` is intact, by step, and why the others are not."""
    candidates, skipped = _candidates(run_dir)
    intact: dict[int, Path] = {}
    for directory in candidates:
        problem = _damage(directory, world_size, fingerprint, (rank,))
        if problem is None:
            manifest = json.loads((directory / "manifest.json").read_text())
            intact[int(manifest["step"])] = directory
        else:
            skipped.append(f"{directory.name} {problem}")
    return intact, skipped


def agree_latest(
    run_dir: Path, world_size: int, fingerprint: dict[str, Any], bookkeeping: Comm
) -> tuple[int, Path]:
    """The newest checkpoint whose file is intact on every rank (a collective over
    ``bookkeeping``): each rank verifies only its own file, in its own view of ``run_dir``.

    Each round, every rank proposes its newest intact step at or below the bound (-1: none,
    -2: it cannot read the checkpoints); the bound becomes the smallest proposal, until all
    proposals are equal. Returns (step, this rank's directory of it).

    Raises:
        CheckpointError: on every rank alike, when no checkpoint is intact for all.
    """
    error: CheckpointError | None = None
    try:
        intact, skipped = _intact(run_dir, world_size, fingerprint, bookkeeping.rank)
    except CheckpointError as raised:
        error, intact, skipped = raised, {}, []
    bound = None
    while True:
        mine = (
            -2
            if error is not None
            else max((step for step in intact if bound is None or step <= bound), default=-1)
        )
        proposals = torch.tensor([mine, -mine], dtype=torch.int64)
        bookkeeping.all_reduce(proposals, op="max", role=Role.OTHER).wait()
        highest, lowest = int(proposals[0]), -int(proposals[1])
        if lowest == highest and lowest >= 0:
            return lowest, intact[lowest]
        if lowest < 0:
            break
        bound = lowest
    if error is not None:
        raise error
    own = "; ".join(skipped) if skipped else "its own files are intact"
    if lowest == -2:
        own += ", but another rank cannot read the checkpoints (see its error)"
    raise CheckpointError(
        f"--resume: no checkpoint in {run_dir / 'checkpoints'} is intact on every rank "
        f"(rank {bookkeeping.rank}: {own}); start afresh (--overwrite) or restore a copy"
    )


def _files_damage(
    directory: Path, hashes: dict[str, str], ranks: Collection[int] | None
) -> str | None:
    """Why one of the listed files of ``ranks`` (None: every file) is missing or fails its
    checksum, or None: a rank reads only its own files (no shared filesystem needed)."""
    mine = None if ranks is None else {f"rank{rank}.pt" for rank in ranks}
    for name, expected in hashes.items():
        if mine is not None and name not in mine:
            continue
        path = directory / name
        if not path.exists():
            return f"is incomplete: {path} is missing"
        if _sha256(path) != expected:
            return f"is damaged: {path} fails its checksum (truncated or corrupted)"
    return None


def _damage(
    directory: Path,
    world_size: int,
    fingerprint: dict[str, Any],
    ranks: Collection[int] | None = None,
) -> str | None:
    """Why the checkpoint in ``directory`` cannot be loaded, or None if it is intact (the
    files of ``ranks`` verified; None: every file).

    Raises:
        CheckpointError: the checkpoint is intact but of another world size or configuration.
    """
    manifest_path = directory / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
        int(manifest["step"])
        hashes = dict(manifest["sha256"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        reason = (
            "is missing" if isinstance(error, FileNotFoundError) else f"is unreadable ({error})"
        )
        return f"is incomplete: {manifest_path} {reason}"
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"--resume: {directory} was written by another lowcomm version (checkpoint format "
            f"{manifest.get('format')!r}; this version reads format {FORMAT_VERSION}); continue "
            f"it with the lowcomm that wrote it, or start a new run (--overwrite or another --out)"
        )
    saved = _options_added_later(
        _by_content({**_ADDED_LATER, **manifest.get("fingerprint", {})}), fingerprint["method"]
    )
    for key, value in fingerprint.items():
        if key == "steps" and _extends(int(manifest["step"]), saved, value, directory):
            continue
        if key == "ranks_per_worker":  # another layout is re-sharded (train/reshard.py)
            continue
        if key == "faults":
            _check_same_trace(saved.get(key), value)
        if saved.get(key) != value:
            name, before, now = _first_difference(key, saved.get(key), value)
            raise CheckpointError(
                f"--resume: the checkpoint was written with {name}={before!r} but this "
                f"run has {name}={now!r}; an exact resume needs the same setting (drop the "
                f"override, or start a new run with a different --out)"
            )
    damage = _files_damage(directory, hashes, ranks)
    if damage is not None:
        return damage
    layout = (world_size, fingerprint["ranks_per_worker"])
    if (manifest.get("world_size"), saved.get("ranks_per_worker")) != layout:
        _check_reshardable(directory, manifest, world_size, fingerprint)
    return None


def _check_same_trace(saved: Any, value: Any) -> None:
    """Refuse, naming both digests, a resume whose --faults file is not the trace the
    checkpoint was written with (its saved cursor and quorum index into that trace).

    Raises:
        CheckpointError: in one line.
    """
    before = saved.get("trace") if isinstance(saved, dict) else None
    now = value.get("trace") if isinstance(value, dict) else None
    if isinstance(before, str) and isinstance(now, str) and before != now:
        raise CheckpointError(
            f"--faults: the checkpoint was written replaying the trace {before} but this "
            f"run's --faults file now reads {now}; a resume continues the same trace from where it "
            f"stood, so resume with the file the run was written with (or start a new run "
            f"with a different --out)"
        )


def _options_added_later(saved: dict[str, Any], method: str) -> dict[str, Any]:
    """A checkpoint written before an option of ``method`` existed does not name it: it ran
    with what the option's default keeps, so the saved options take that default."""
    from lowcomm.strategies import options_class, strategy_class

    options = saved.get("options")
    kind = options_class(strategy_class(method))
    if kind is None or not isinstance(options, dict):
        return saved
    defaults = {
        field.name: field.default
        for field in dataclasses.fields(kind)
        if field.default is not dataclasses.MISSING
    }
    normalised: dict[str, Any] = json.loads(json.dumps(defaults, default=str))
    return {**saved, "options": {**normalised, **options}}


def _first_difference(key: str, saved: Any, value: Any) -> tuple[str, Any, Any]:
    """The first setting under ``key`` where two fingerprints differ (``data.tokenizer``
    rather than the whole ``data`` group)."""
    if isinstance(saved, dict) and isinstance(value, dict):
        for inner in [*value, *(k for k in saved if k not in value)]:
            if saved.get(inner) != value.get(inner):
                return _first_difference(f"{key}.{inner}", saved.get(inner), value.get(inner))
    return key, saved, value


def _by_content(saved: dict[str, Any]) -> dict[str, Any]:
    """A fingerprint written before tokenizers were named by content names its tokenizer by
    path: read that file's content now (it was the run's tokenizer; if it is gone, the path
    stays and cannot match)."""
    data = saved.get("data")
    if not isinstance(data, dict):
        return saved
    tokenizer = data.get("tokenizer")
    if not isinstance(tokenizer, str) or tokenizer.startswith(_TOKENIZER_DIGEST):
        return saved
    return {**saved, "data": {**data, "tokenizer": tokenizer_identity(tokenizer)}}


def _check_reshardable(
    directory: Path, manifest: dict[str, Any], world_size: int, fingerprint: dict[str, Any]
) -> None:
    """A checkpoint of another layout (workers x ranks per worker) is re-sharded by each
    resumed rank (``lowcomm.train.reshard``); refuse here, before any worker starts, what
    cannot be: a manifest that disagrees with the rank files present, or non-IID data.

    Raises:
        CheckpointError: in one line, naming why.
    """
    old_world = int(manifest.get("world_size", 0))
    old_ranks = int(manifest.get("fingerprint", {}).get("ranks_per_worker", 1))
    new_ranks = int(fingerprint["ranks_per_worker"])
    listed = set(manifest.get("sha256", {}))
    expected = {f"rank{rank}.pt" for rank in range(old_world)}
    present = {path.name for path in directory.glob("rank*.pt")}
    if old_world < 1 or old_world % old_ranks or listed != expected or present != expected:
        raise CheckpointError(
            f"--resume: {directory} cannot be re-sharded for {world_size} processes: its "
            f"manifest says {old_world} processes but lists {sorted(listed)} and the directory "
            f"holds {sorted(present)}; restore the checkpoint, or resume an intact one"
        )
    split = fingerprint.get("data", {}).get("split", "iid")
    if split != "iid":
        raise CheckpointError(
            f"--workers: the checkpoint has {old_world // old_ranks} workers x {old_ranks} ranks "
            f"and this run {world_size // new_ranks} x {new_ranks}, but --split {split} cuts "
            f"each worker's block of the data by the worker count; resume with the old "
            f"--workers and --ranks-per-worker, or train with --split iid"
        )


def _extends(step: int, saved: dict[str, Any], steps: Any, directory: Path) -> bool:
    """Whether a resume with ``--steps steps`` extends a finished run: the checkpoint is its
    final one (taken at its last step). Fewer steps than it finished are refused.

    Raises:
        CheckpointError: ``steps`` is below the finished run's steps.
    """
    if step != saved.get("steps") or not isinstance(steps, int):
        return False
    if steps < step:
        raise CheckpointError(
            f"--steps: {steps} is below the {step} steps the run in {directory.parent.parent} "
            f"finished; to extend it pass --steps above {step}"
        )
    return True


def extension_of(directory: Path, steps: int) -> int | None:
    """The finished steps a resume from checkpoint ``directory`` extends to ``steps``, or None
    when it continues an unfinished run (or adds no steps)."""
    manifest = json.loads((directory / "manifest.json").read_text())
    finished = manifest.get("fingerprint", {}).get("steps")
    step = int(manifest["step"])
    return step if step == finished and steps > step else None


def read_rank_state(
    directory: Path, rank: int, device: torch.device | str = "cpu", *, mmap: bool = False
) -> dict[str, Any]:
    """Load one worker's state (tensors and plain containers only) onto ``device``; with
    ``mmap``, its tensors mapped from the file (copy-on-write) rather than read into memory."""
    try:
        path = directory / f"rank{rank}.pt"
        state = torch.load(path, weights_only=True, map_location=device, mmap=mmap)
    except Exception as error:  # torch raises several types for a bad file
        raise CheckpointError(
            f"--resume: cannot load {directory / f'rank{rank}.pt'}: {error}"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"--resume: {directory / f'rank{rank}.pt'} is not a lowcomm checkpoint"
        )
    return state
