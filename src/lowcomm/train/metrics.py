"""The run directory: metrics.jsonl, summary.json, config.json and loss.png (rank 0 only)."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from lowcomm.atomic import atomic_path, atomic_write_bytes, atomic_write_text
from lowcomm.comm.network import NetworkProfile
from lowcomm.train.records import ProcessTotals, StepMetrics
from lowcomm.train.rundir import MODEL_CONFIG_COPY, TOKENIZER_COPY, run_directory

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from lowcomm.config import TrainConfig


_OPTIONAL = frozenset({"membership", "quorum", "membership_events", "dropped"})


@dataclass
class StepRecord:
    """One line of metrics.jsonl: a step, averaged over workers, with per-worker detail."""

    step: int
    lr: float
    train_loss: float
    val_loss: float | None
    compute_s: float
    exposed_comm_s: float
    utilization: float
    bytes_sent_per_worker: float
    clock_s: float
    microbatches_per_worker: list[int]
    committed_steps: int
    tokens: int
    exposed_comm_s_per_worker: list[float]
    clock: str
    extras: dict[str, float]
    """Method-specific numbers (StepStats.extras) as seen by worker 0."""
    membership: dict[str, int] | None = None
    """On the first step after a membership change (an elastic resume on another number of
    workers): the checkpoint's step and the old and new worker counts (absent otherwise)."""
    quorum: int | None = None
    """With declared faults: the step's quorum size (absent otherwise)."""
    membership_events: list[dict[str, object]] | None = None
    """With declared faults: the crash, leave, join and rejoin events of this step."""
    dropped: bool | None = None
    """With declared faults: true when the step was dropped on every member."""

    def line(self) -> str:
        """This record as one metrics.jsonl line (without the optional fields that are not
        set: ``membership`` and the fault fields)."""
        fields = {k: v for k, v in self.__dict__.items() if k not in _OPTIONAL or v is not None}
        return json.dumps(fields) + "\n"

    @classmethod
    def from_workers(
        cls,
        step: int,
        lr: float,
        workers: list[StepMetrics],
        val_loss: float | None,
        clock: str,
        extras: dict[str, float] | None = None,
    ) -> StepRecord:
        """The record of a step from every process's :class:`StepMetrics` (rank order)."""
        compute = statistics.fmean(w.compute_s for w in workers)
        exposed = statistics.fmean(w.exposed_comm_s for w in workers)
        total = compute + exposed
        return cls(
            step=step,
            lr=lr,
            train_loss=statistics.fmean(w.loss for w in workers),
            val_loss=val_loss,
            compute_s=compute,
            exposed_comm_s=exposed,
            utilization=compute / total if total > 0 else 1.0,
            bytes_sent_per_worker=statistics.fmean(w.bytes_sent for w in workers),
            clock_s=max(w.clock_s for w in workers),
            microbatches_per_worker=[int(w.microbatches) for w in workers],
            committed_steps=int(workers[0].committed_steps),
            tokens=int(sum(w.tokens for w in workers)),
            exposed_comm_s_per_worker=[w.exposed_comm_s for w in workers],
            clock=clock,
            extras=dict(extras or {}),
        )


def read_records(path: Path, *, before: int) -> list[StepRecord]:
    """The records of ``path`` (metrics.jsonl) for steps ``< before``; a torn last line (a
    run killed mid-write) is dropped."""
    records: list[StepRecord] = []
    if not path.exists():
        return records
    for line in path.read_text().splitlines():
        try:
            record = StepRecord(**json.loads(line))
        except (ValueError, TypeError):
            continue
        if record.step < before:
            records.append(record)
    return records


def membership_changes(records: list[StepRecord]) -> list[dict[str, int]]:
    """Every membership change the records hold: step, old and new worker counts."""
    return [
        {
            "step": r.membership["step"],
            "old_workers": r.membership["old_workers"],
            "new_workers": r.membership["new_workers"],
        }
        for r in records
        if r.membership is not None
    ]


def _previous_extensions(summary_path: Path) -> list[int]:
    """extended_at_steps of the summary a resumed run leaves behind (empty if none)."""
    try:
        previous = json.loads(summary_path.read_text()).get("extended_at_steps", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [int(step) for step in previous] if isinstance(previous, list) else []


def keep_tokenizer(tokenizer: str | None, directory: Path) -> None:
    """Copy a given tokenizer into the run directory (atomically; nothing when it is that
    copy already), so the run resumes after its source moves or is deleted."""
    if tokenizer is None:
        return
    source, copy = Path(tokenizer).expanduser(), directory / TOKENIZER_COPY
    if copy.exists() and copy.resolve() == source.resolve():
        return
    copy.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(copy, source.read_bytes())
    # A Hugging Face tokenizer's other files (tokenizer_config.json: its eos_token, ...) too,
    # so the export of a resumed run carries them.
    from lowcomm.models.export import TOKENIZER_FILES

    if (source.parent / "tokenizer_config.json").is_file():
        for name in TOKENIZER_FILES[1:]:
            if (source.parent / name).is_file():
                atomic_write_bytes(copy.parent / name, (source.parent / name).read_bytes())


def keep_model_config(model_config: str | None, directory: Path) -> None:
    """Copy the run's --model.config (an --init-from model's config.json) into the run
    directory, so the run resumes after its source moves or is deleted."""
    if model_config is None:
        return
    source, copy = Path(model_config).expanduser(), directory / MODEL_CONFIG_COPY
    if copy.exists() and copy.resolve() == source.resolve():
        return
    copy.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(copy, source.read_bytes())


def loggers(config: TrainConfig) -> set[str]:
    """Where the run's step records go: --log's entries, and tensorboard with
    --tensorboard (its older spelling). metrics.jsonl is written whatever --log says: a
    resume and the benchmarks read it."""
    return {"jsonl", *config.run.log} | ({"tensorboard"} if config.run.tensorboard else set())


def check_loggers(config: TrainConfig) -> None:
    """The pre-flight of --log and --tensorboard: the packages they write through are
    installed and, for W&B online, a login exists. Raises ConfigError in one line."""
    from lowcomm.config import ConfigError

    chosen = loggers(config)
    if "tensorboard" in chosen:
        from lowcomm.train.tensorboard import MISSING, tensorboard_available

        if not tensorboard_available():
            raise ConfigError(MISSING)
    if "wandb" in chosen:
        from lowcomm.train.wandb_log import check_wandb

        check_wandb()


class RunWriter:
    """Writes the run directory as training goes (rank 0)."""

    def __init__(self, config: TrainConfig, *, resume_step: int | None = None) -> None:
        self.config = config
        self.directory = run_directory(config)
        self.directory.mkdir(parents=True, exist_ok=True)
        keep_tokenizer(config.data.tokenizer, self.directory)
        keep_model_config(config.model.config, self.directory)
        atomic_write_text(self.directory / "config.json", config.to_json() + "\n")
        metrics_path = self.directory / "metrics.jsonl"
        self.records: list[StepRecord] = []
        self.membership: dict[str, int] | None = None
        #: With declared faults: summary.json's ``faults`` (set before :meth:`finish`).
        self.faults: dict[str, Any] | None = None
        """A membership change this run made at its start, for its first step's record."""
        self.extended_at: list[int] = []
        """The finished steps at which this run was extended (summary.json's
        extended_at_steps)."""
        if resume_step is not None:
            self.extended_at = _previous_extensions(self.directory / "summary.json")
            # Keep the steps the checkpoint covers; later lines belong to the run that died.
            self.records = read_records(metrics_path, before=resume_step)
            atomic_write_text(metrics_path, "".join(r.line() for r in self.records))
        # Kept open for the whole run (one line per step), closed by close_steps().
        self._metrics: TextIO | None = open(metrics_path, "a" if resume_step is not None else "w")  # noqa: SIM115
        self._tensorboard: Any = None
        if "tensorboard" in loggers(config):
            from lowcomm.train.tensorboard import TensorBoardLog

            before = sum(r.bytes_sent_per_worker for r in self.records)
            self._tensorboard = TensorBoardLog(self.directory, before)
        self._wandb: Any = None
        if "wandb" in loggers(config):
            from lowcomm.train.wandb_log import WandbLog

            self._wandb = WandbLog(config, self.directory, resumed=resume_step is not None)
        self._progress: Any = None
        if config.run.progress:
            from tqdm import tqdm

            self._progress = tqdm(
                total=config.run.steps,
                initial=len(self.records),
                desc=f"{config.method}",
                unit="step",
            )

    def write_step(self, record: StepRecord) -> None:
        self.records.append(record)
        if self._metrics is not None:
            if self.membership is not None:
                record.membership, self.membership = self.membership, None
            self._metrics.write(record.line())
            self._metrics.flush()
        if self._tensorboard is not None:
            self._tensorboard.write_step(record)
        if self._wandb is not None:
            self._wandb.write_step(record)
        if self._progress is not None:
            postfix = {"loss": f"{record.train_loss:.3f}", "util": f"{record.utilization:.2f}"}
            if record.val_loss is not None:
                postfix["val"] = f"{record.val_loss:.3f}"
            self._progress.set_postfix(postfix)
            self._progress.update(1)

    def close_steps(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._progress is not None:
            self._progress.close()
            self._progress = None

    def finish(
        self,
        *,
        per_process: list[ProcessTotals],
        bytes_by_role: dict[str, float],
        num_params: int,
        final_val_loss: float | None,
        wall_clock_s: float,
        clock_kind: str,
        network: NetworkProfile,
        replica_network: NetworkProfile | None = None,
        compute_model: dict[str, object] | None = None,
        committed_tokens: int | None = None,
        task: dict[str, Any] | None = None,
        final_val_loss_note: str | None = None,
    ) -> dict[str, Any]:
        """Write summary.json and loss.png, print the summary table; return the summary.

        ``final_val_loss`` None: the final validation had no batch on any worker, whose
        reason ``final_val_loss_note`` says (the summary's ``final_val_loss_note``).

        ``per_process`` holds one entry per process: with --ranks-per-worker R, R per worker.
        ``task``: what was trained (:meth:`lowcomm.train.task.Task.describe`); a task counted
        in samples has ``samples`` and ``committed_samples`` where others have tokens."""
        summary = self._totals(per_process, num_params, final_val_loss)
        if final_val_loss_note is not None:
            summary["final_val_loss_note"] = final_val_loss_note
        summary.update(
            wall_clock_s=wall_clock_s,
            bytes_by_role=bytes_by_role,
            clock=clock_kind,
            compute_model=compute_model,
            committed_tokens=committed_tokens,
            token_budget=self.config.run.token_budget,
            network=_describe_network(network, speed_factors=True),
            # (the summary's key names the option, --inner-network)
            inner_network=None if replica_network is None else _describe_network(replica_network),
            per_worker=_per_process_columns(per_process),
        )
        if self.extended_at:
            summary["extended_at_steps"] = self.extended_at
        changes = membership_changes(self.records)
        if changes:
            summary["membership_changes"] = changes
        if self.faults is not None:
            summary["faults"] = self.faults
        if task is not None and task.get("unit", "tokens") != "tokens":
            summary.update(task=task, unit=task["unit"])
            summary["samples"] = summary.pop("tokens")
            summary["committed_samples"] = summary.pop("committed_tokens")
            del summary["token_budget"]
        summary = {key: summary[key] for key in _SUMMARY_ORDER if key in summary}
        if self.config.placement.device == "cuda":
            # torch.cuda.max_memory_allocated, the honest figure on a GPU (it includes
            # activations and the transient copies state_bytes leaves out).
            peak = [int(p.peak_memory) for p in per_process]
            summary["peak_device_memory_bytes_per_worker"] = max(peak)
            summary["per_worker"]["peak_device_memory_bytes"] = peak
        self._publish(summary)
        return summary

    def _publish(self, summary: dict[str, Any]) -> None:
        """Write summary.json, draw loss.png, hand both to W&B, print the summary table."""
        atomic_write_text(
            self.directory / "summary.json",
            json.dumps(summary, indent=2, default=_json_default) + "\n",
        )
        if self.config.run.plot:
            self._plot()
        if self._wandb is not None:
            # (after the plot: the W&B run gets loss.png; its run stays open across
            # close_steps so that the summary joins the steps' run)
            self._wandb.finish(
                json.loads(json.dumps(summary, default=_json_default)), self.directory
            )
            self._wandb = None
        print(format_summary(summary, self.directory))

    def _totals(
        self, per_process: list[ProcessTotals], num_params: int, final_val_loss: float | None
    ) -> dict[str, Any]:
        """The summary's run-wide numbers: means over processes, the slowest clock."""
        ranks = self.config.placement.ranks_per_worker
        compute_mean = statistics.fmean(p.compute_s for p in per_process)
        exposed_mean = statistics.fmean(p.exposed_comm_s for p in per_process)
        total = compute_mean + exposed_mean
        sent_mean = statistics.fmean(p.bytes_sent for p in per_process)
        last = self.records[-1] if self.records else None
        return {
            "method": self.config.method,
            "workers": len(per_process) // ranks,
            "ranks_per_worker": ranks,
            "steps": len(self.records),
            "num_params": num_params,
            "tokens": int(sum(p.tokens for p in per_process)),
            "final_train_loss": last.train_loss if last else math.nan,
            "final_val_loss": final_val_loss,
            "compute_s": compute_mean,
            "exposed_comm_s": exposed_mean,
            "utilization": compute_mean / total if total > 0 else 1.0,
            "bytes_sent_per_worker": ranks * sent_mean,
            "bytes_sent_per_rank": sent_mean,
            # Summary keys (a file format): "inner" is the link between a worker's ranks.
            "levels": {
                "inner": _level(per_process, "replica_bytes_sent", "replica_exposed_comm_s"),
                "outer": _level(per_process, "outer_bytes_sent", "outer_exposed_comm_s"),
            },
            "modeled_time_s": max(p.clock_s for p in per_process),
            "state_bytes_per_worker": _state_per_worker(per_process, self.config),
            # The tensors one rank holds (1/R of a sharded worker's), and its measured peak
            # (CUDA: the allocator's peak; CPU: peak RSS), the largest over the ranks.
            "state_bytes_per_rank": int(max(p.state_bytes for p in per_process)),
            "peak_memory_bytes_per_rank": int(max(p.peak_memory for p in per_process)),
        }

    def _plot(self) -> None:
        import matplotlib.pyplot as plt

        figure = self.figure()
        with atomic_path(self.directory / "loss.png") as temporary:
            figure.savefig(temporary, dpi=100, format="png")
        plt.close(figure)

    def figure(self) -> Figure:
        """loss.png's figure: the loss by step and by modeled time, an elastic resume's
        change of workers, and each declared fault's membership event (crash, leave, join,
        rejoin: a vertical line at the start of the step it lands on, in both panels)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [r.step + 1 for r in self.records]
        figure, (by_step, by_time) = plt.subplots(1, 2, figsize=(10, 4))
        # One colour per series in both panels (not matplotlib's per-axis colour cycle).
        train_colour, val_colour = "C0", "C1"
        train = [r.train_loss for r in self.records]
        by_step.plot(steps, train, color=train_colour, label="train")
        by_time.plot([r.clock_s for r in self.records], train, color=train_colour, label="train")
        val = [(r.step + 1, r.clock_s, r.val_loss) for r in self.records if r.val_loss is not None]
        if val:
            val_loss = [v[2] for v in val]
            by_step.plot([v[0] for v in val], val_loss, "o-", color=val_colour, label="validation")
            by_time.plot([v[1] for v in val], val_loss, "o-", color=val_colour, label="validation")
        for change in membership_changes(self.records):
            label = f"{change['old_workers']} -> {change['new_workers']} workers"
            by_step.axvline(change["step"], color="grey", linestyle="--", label=label)
        _mark_membership_events(self.records, by_step, by_time)
        by_step.set_xlabel("step")
        by_step.set_ylabel("loss")
        by_time.set_xlabel(f"time on the {self.config.comm.clock} clock (s)")
        for axis in (by_step, by_time):
            axis.grid(alpha=0.3)
            axis.legend()
        figure.suptitle(
            f"{self.config.method}, {self.config.placement.workers} workers, network {self.config.comm.network}"
        )
        figure.tight_layout()
        return figure


#: The colour of each membership event's line in loss.png.
_EVENT_COLOURS = {"crash": "red", "leave": "orange", "join": "green", "rejoin": "green"}


def _mark_membership_events(records: list[StepRecord], by_step: Axes, by_time: Axes) -> None:
    """A vertical line per membership event, at the start of its step: after ``step``
    completed steps on the step axis, at the previous step's end on the time axis. Each line's
    gid is ``membership:KIND:WORKER``; one legend entry per kind."""
    labelled: set[str] = set()
    previous_s = 0.0
    for record in records:
        for event in record.membership_events or []:
            kind = str(event["kind"])
            label = None if kind in labelled else kind
            labelled.add(kind)
            colour = _EVENT_COLOURS.get(kind, "grey")
            for axis, x in ((by_step, record.step), (by_time, previous_s)):
                line = axis.axvline(x, color=colour, linestyle=":", alpha=0.7, label=label)
                line.set_gid(f"membership:{kind}:{event['worker']}")
        previous_s = record.clock_s


#: The order of summary.json's keys (unchanged since before the named records).
_SUMMARY_ORDER = (
    "method", "workers", "ranks_per_worker", "steps", "extended_at_steps", "membership_changes",
    "faults",
    "num_params", "tokens", "committed_tokens", "token_budget", "unit", "samples",
    "committed_samples", "task", "final_train_loss",
    "final_val_loss", "final_val_loss_note", "wall_clock_s", "compute_s", "exposed_comm_s", "utilization",
    "bytes_sent_per_worker", "bytes_sent_per_rank", "levels", "bytes_by_role", "clock",
    "compute_model", "modeled_time_s", "state_bytes_per_worker", "network", "inner_network", "per_worker",
    "state_bytes_per_rank", "peak_memory_bytes_per_rank",
)  # fmt: skip


def _state_per_worker(per_process: list[ProcessTotals], config: TrainConfig) -> int:
    """The state bytes of the largest worker: one rank's (its ranks hold replicas), or with
    --worker-sharding fsdp the sum over its ranks (each holds a shard)."""
    held = [int(p.state_bytes) for p in per_process]
    if config.placement.worker_sharding != "fsdp":
        return max(held)
    ranks = config.placement.ranks_per_worker
    return max(sum(held[m : m + ranks]) for m in range(0, len(held), ranks))


def _level(per_process: list[ProcessTotals], sent: str, exposed: str) -> dict[str, float]:
    return {
        "bytes_sent_per_rank": statistics.fmean(getattr(p, sent) for p in per_process),
        "exposed_comm_s": statistics.fmean(getattr(p, exposed) for p in per_process),
    }


def _loss_cell(loss: float | None) -> str:
    """A loss in the summary table (none: no worker held a validation batch)."""
    return "none (no validation batch)" if loss is None else f"{loss:.4f}"


def _describe_network(network: NetworkProfile, *, speed_factors: bool = False) -> dict[str, Any]:
    described: dict[str, Any] = {
        "name": network.name,
        "bandwidth_gbps": network.bandwidth_gbps,
        "latency_ms": network.latency_ms,
    }
    if speed_factors:
        described["speed_factors"] = list(network.speed_factors)
    return described


def _per_process_columns(per_process: list[ProcessTotals]) -> dict[str, list[Any]]:
    return {
        "compute_s": [p.compute_s for p in per_process],
        "exposed_comm_s": [p.exposed_comm_s for p in per_process],
        "clock_s": [p.clock_s for p in per_process],
        "bytes_sent": [p.bytes_sent for p in per_process],
        "state_bytes": [int(p.state_bytes) for p in per_process],
    }


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return str(value)


def _human_bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(count) < 1000 or unit == "TB":
            return f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"


def _level_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """Per-level rows of a hierarchical run (--ranks-per-worker > 1)."""
    if summary.get("ranks_per_worker", 1) <= 1 or not summary.get("levels"):
        return []
    inner = summary["inner_network"]
    rows = [
        (
            "inner network",
            f"{inner['name']} ({inner['bandwidth_gbps']} Gbit/s, {inner['latency_ms']} ms)",
        )
    ]
    clock = summary["clock"]
    for name in ("inner", "outer"):
        level = summary["levels"][name]
        rows.append((f"{name} sent per rank", _human_bytes(level["bytes_sent_per_rank"])))
        rows.append((f"{name} exposed ({clock} clock)", f"{level['exposed_comm_s']:.2f} s"))
    return rows


def _compute_model_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """How the virtual clock charged compute; on the real clock on a CPU, the share of the
    measured compute that rank 0's thread ran on a core (the rest waited for one)."""
    model = summary.get("compute_model")
    if model and model.get("model") == "wall":
        rows = []
        passes = model.get("microbatch_wall_s")
        if passes:
            since = " since the resume" if model.get("microbatches_since_resume") else ""
            rows.append(
                (
                    "micro-batch",
                    f"median {passes['median'] * 1e3:.1f} ms, least {passes['min'] * 1e3:.1f} ms "
                    f"(rank 0's {passes['count']}{since}, wall)",
                )
            )
        if "on_core" in model:
            rows.append(("compute on a core", f"{model['on_core']:.1%} (rank 0's thread CPU time)"))
        return rows
    if not model:
        return []
    if "seconds_per_microbatch" not in model:
        return [("compute model", str(model["model"]))]
    return [
        (
            "compute model",
            f"{model['model']} ({model['seconds_per_microbatch'] * 1e3:.2f} ms per micro-batch)",
        )
    ]


def format_summary(summary: dict[str, Any], directory: Path) -> str:
    """The final table printed after a run."""
    clock = summary["clock"]
    rows = [
        ("method", summary["method"]),
        ("workers", str(summary["workers"])),
        *(
            [("ranks per worker", str(summary["ranks_per_worker"]))]
            if summary.get("ranks_per_worker", 1) > 1
            else []
        ),
        ("steps", str(summary["steps"])),
        ("parameters", f"{summary['num_params'] / 1e6:.2f} M"),
        *[(unit, f"{summary[unit]:,}") for unit in ("tokens", "samples") if unit in summary],
        ("final train loss", f"{summary['final_train_loss']:.4f}"),
        ("final val loss", _loss_cell(summary["final_val_loss"])),
        (
            "network",
            f"{summary['network']['name']} ({summary['network']['bandwidth_gbps']} Gbit/s, {summary['network']['latency_ms']} ms)",
        ),
        (f"time ({clock} clock)", f"{summary['modeled_time_s']:.2f} s"),
        (f"compute ({clock} clock)", f"{summary['compute_s']:.2f} s"),
        *_compute_model_rows(summary),
        (f"exposed comm ({clock} clock)", f"{summary['exposed_comm_s']:.2f} s"),
        ("utilization", f"{summary['utilization']:.1%}"),
        ("sent per worker", _human_bytes(summary["bytes_sent_per_worker"])),
        *_level_rows(summary),
        ("state per worker", _human_bytes(summary["state_bytes_per_worker"])),
        ("wall clock", f"{summary['wall_clock_s']:.1f} s"),
        ("run directory", str(directory)),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"  {name.ljust(width)}  {value}" for name, value in rows]
    rule = "-" * (width + 2 + max(len(v) for _, v in rows) + 2)
    return "\n".join([rule, *lines, rule])
