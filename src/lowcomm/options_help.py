"""``lowcomm train --help``, grouped by component, and docs/options.md, its long form.

tyro groups options only by nested dataclass, and the flags of TrainConfig's placement, run,
comm, numerics and fault components have no prefix, so the help groups them by what they
mean (:data:`COMPONENTS`), written here from the same source tyro reads: the dataclass
fields, their types, defaults and docstrings. ``--help`` gives each
option its first sentence (or a shorter line from :data:`SHORT`); docs/options.md gives
every docstring whole, in the same groups. ``python -m lowcomm.options_help > docs/options.md``
writes the page again.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import re
import shutil
import textwrap
import types
import typing
from typing import Any, Literal

#: The groups the options without a prefix are shown in, in the order --help shows them.
#: A field listed nowhere is shown under "Other options", so a new one is never hidden.
COMPONENTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Method", ("method",)),
    ("Training", ("steps", "token_budget", "microbatches_per_step", "max_grad_norm", "seed")),
    (
        "Workers and placement",
        ("workers", "ranks_per_worker", "workers_per_process", "worker_sharding", "device"),
    ),
    (
        "Network",
        (
            "network",
            "bandwidth_gbps",
            "latency_ms",
            "inner_network",
            "inner_bandwidth_gbps",
            "inner_latency_ms",
            "comm_dtype",
            "collective_timeout_s",
        ),
    ),
    (
        "Clock",
        ("clock", "seconds_per_microbatch", "compute_model", "calibration", "speed_factors"),
    ),
    ("Numerics and speed", ("precision", "activation_checkpointing", "compile", "tf32")),
    (
        "Run directory, evaluation and logging",
        (
            "out",
            "overwrite",
            "eval_every",
            "eval_batches",
            "log_every",
            "progress",
            "plot",
            "log",
            "tensorboard",
            "wandb_project",
            "wandb_name",
        ),
    ),
    (
        "Faults: workers that fail, straggle and join (docs/train.md)",
        (
            "faults",
            "fault_mtbf_s",
            "fault_replace_after_s",
            "fault_slow_fraction",
            "fault_slow_factor",
            "fault_detection_s",
            "fault_seed",
            "fault_min_workers",
            "fault_quorum_wait_s",
            "membership",
        ),
    ),
    (
        "Checkpoints, resuming and initial weights",
        ("checkpoint_every", "keep_checkpoints", "resume", "stop_after", "init_from"),
    ),
)

#: The nested components' titles (their fields are shown under ``--<name>.``).
TITLES = {
    "model": "Model",
    "data": "Data",
    "optim": "Optimizer",
    "schedule": "Learning-rate schedule",
}

#: Nested components that --help gives one line per option, and their titles.
BRIEF_TITLES = {"membership_options": "Live membership (--membership torchft)"}

#: The command line's own options of ``lowcomm train`` (not TrainConfig's fields).
FILE_OPTIONS = (
    (
        "--config FILE",
        "Take every option from a TOML file (or a run directory's config.json); flags given "
        "beside it override the file.",
    ),
    (
        "--print-config",
        "Write the TOML of the options given to stdout and exit without training.",
    ),
)

#: A shorter line than the docstring's first sentence, for the options whose first
#: sentence is long.
SHORT = {
    "ranks_per_worker": "Ranks (processes) per worker, sharing its work over the inner link.",
    "workers_per_process": (
        "Workers simulated in one process, as threads: 1, --workers, or a divisor of it."
    ),
    "worker_sharding": (
        "How a worker of --ranks-per-worker R > 1 holds its model: replicate or fsdp (1/R per rank)."
    ),
    "steps": "Optimizer steps to take (more than a finished run's, with --resume, extend it).",
    "clock": "real: wall time with delayed transfers; virtual: modeled time per worker.",
    "token_budget": "End the run once the workers have committed this many tokens.",
    "compute_model": (
        "How the virtual clock charges compute: calibrated (fixed costs) or cpu-time."
    ),
    "calibration": "A JSON file of calibrated compute costs, read if it exists, else written.",
    "out": "Run directory (default: runs/<method>-<network>-w<workers>-s<seed>[-<hash>]).",
    "overwrite": "Clear the run files of the run directory first.",
    "log_every": "Read the loss and gather the workers' step metrics every this many steps.",
    "precision": "fp32, or bf16-mixed (autocast in bfloat16, float32 master weights and states).",
    "activation_checkpointing": "Recompute each transformer block's activations in the backward.",
    "compile": "Compile each transformer block's forward with torch.compile.",
    "tf32": "On cuda, float32 matmuls use TF32 tensor cores (False keeps full float32).",
    "comm_dtype": "The dtype gradients and pseudo-gradients travel in (bf16 halves the bytes).",
    "plot": "Draw OUT/loss.png at the end of the run.",
    "tensorboard": "Also write TensorBoard event files under OUT/tensorboard/.",
    "log": "Where the step records also go: tensorboard, wandb (metrics.jsonl always).",
    "resume": "Resume from this run directory's latest checkpoint, or auto.",
    "init_from": "Start from this model (a run's OUT, a lowcomm or local HF model directory).",
    "membership": "Who takes part in each round: static, or torchft (workers die and join).",
}

#: Where --help sends the reader for the details.
FOOTER = (
    "Every option in full: docs/options.md. Config files: docs/config-files.md.\n"
    "The methods: `lowcomm methods`.\n"
)

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`])")


@dataclasses.dataclass(frozen=True)
class Option:
    """One option as the help shows it."""

    flag: str
    metavar: str
    default: str
    doc: str
    #: Its key in a config file (``diloco.sync_every``); empty for the command line's own.
    key: str = ""


@dataclasses.dataclass(frozen=True)
class Group:
    """A titled group of options, with a line of its own under the title (may be empty);
    ``brief``: --help gives each option one line (a method's options: the reader of the
    method's group has `lowcomm methods` and docs/options.md for the rest)."""

    title: str
    note: str
    options: tuple[Option, ...]
    brief: bool = False


def groups() -> list[Group]:
    """lowcomm train's options, grouped by component, in the order the help shows them."""
    from lowcomm.strategies import STRATEGIES
    from lowcomm.strategies.option_groups import group_members, option_groups

    fields, hints, docs, keys = _train_options()
    nested = {name for name in fields if _dataclass(hints[name]) is not None}
    method_groups = option_groups(STRATEGIES)
    listed = {name for _, names in COMPONENTS for name in names}
    result: list[Group] = []

    def flat(title: str, names: list[str]) -> Group:
        options = tuple(
            _option(
                f"--{name.replace('_', '-')}",
                hints[name],
                fields[name],
                docs.get(name, ""),
                keys[name],
            )
            for name in names
        )
        return Group(title, "", options)

    result.append(flat(COMPONENTS[0][0], list(COMPONENTS[0][1])))
    for name, title in TITLES.items():
        if name in fields:
            result.append(_nested_group(name, title, hints[name]))
    result += [flat(title, [n for n in names if n in fields]) for title, names in COMPONENTS[1:]]
    others = [n for n in fields if n not in listed and n not in nested]
    others += [n for n in nested if n not in TITLES and n not in method_groups]
    plain = [n for n in others if n not in nested]
    if plain:
        result.append(flat("Other options", plain))
    for name in (n for n in others if n in nested):
        if name in BRIEF_TITLES:  # (one line per option; docs/options.md has the rest)
            shown = _nested_group(name, BRIEF_TITLES[name], hints[name], note=False)
            result.append(dataclasses.replace(shown, brief=True))
        else:
            result.append(_nested_group(name, name, hints[name]))
    result.append(
        Group("Config files", "", tuple(Option(flag, "", "", doc) for flag, doc in FILE_OPTIONS))
    )
    members = group_members(STRATEGIES)
    for group in method_groups:
        if group in fields:
            title = f"Method options --{group}.*"
            # The group's own help, as with_method_options declares it ("Options of ...").
            declared = [getattr(extra, "help", None) for extra in _extras(hints[group])]
            note = next((text for text in declared if text), ", ".join(members[group]))
            method_group = _nested_group(group, title, hints[group], note=False)
            result.append(dataclasses.replace(method_group, note=note, brief=True))
    return result


def _train_options() -> tuple[
    dict[str, dataclasses.Field[Any]], dict[str, Any], dict[str, str], dict[str, str]
]:
    """TrainConfig's options as :func:`_options_of` gives them, the flat components' fields
    in place of the components."""
    from lowcomm.config import FLAT_COMPONENTS, TrainConfig

    fields, hints, docs, keys = _options_of(TrainConfig, "")
    for component, kind in FLAT_COMPONENTS.items():
        # Their options are flags of their own (--workers); a file spells them in the
        # component's table (placement.workers).
        more_fields, more_hints, more_docs, more_keys = _options_of(kind, f"{component}.")
        fields.update(more_fields)
        hints.update(more_hints)
        docs.update(more_docs)
        keys.update(more_keys)
    for name in FLAT_COMPONENTS:
        del fields[name]
    return fields, hints, docs, keys


def _options_of(
    kind: type, prefix: str
) -> tuple[dict[str, dataclasses.Field[Any]], dict[str, Any], dict[str, str], dict[str, str]]:
    """The fields of dataclass ``kind`` by name, their type hints, their docstrings and
    their keys in a config file (``prefix`` and the name)."""
    fields = {field.name: field for field in dataclasses.fields(kind) if field.init}
    hints = typing.get_type_hints(kind, include_extras=True)
    return fields, hints, field_docs(kind), {name: f"{prefix}{name}" for name in fields}


def _nested_group(name: str, title: str, hint: Any, *, note: bool = True) -> Group:
    """The group of a nested component's options (``--model.*``; the data options have no
    prefix), with the first sentence of its class's docstring under the title."""
    import tyro

    kind = _dataclass(hint)
    assert kind is not None
    omit = tyro.conf.OmitArgPrefixes in _extras(hint)
    # (a group renamed on the command line, as --membership.* is for membership_options)
    renamed = [getattr(e, "name", None) for e in _extras(hint) if getattr(e, "name", None)]
    prefix = "--" if omit else f"--{renamed[0] if renamed else name}."
    hints = typing.get_type_hints(kind, include_extras=True)
    docs = field_docs(kind)
    options = tuple(
        _option(
            f"{prefix}{field.name.replace('_', '-')}",
            hints[field.name],
            field,
            docs.get(field.name, ""),
            f"{name}.{field.name}",
        )
        for field in dataclasses.fields(kind)
        if field.init
    )
    summary = _summary(kind) if note else ""
    if summary.rstrip(".").lower() == title.lower():
        summary = ""
    return Group(title, summary, options)


def _extras(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) is typing.Annotated:
        return tuple(typing.get_args(hint)[1:])
    return ()


def _bare(hint: Any) -> Any:
    while typing.get_origin(hint) is typing.Annotated:
        hint = typing.get_args(hint)[0]
    return hint


def _dataclass(hint: Any) -> type | None:
    bare = _bare(hint)
    return bare if isinstance(bare, type) and dataclasses.is_dataclass(bare) else None


def _option(flag: str, hint: Any, field: dataclasses.Field[Any], doc: str, key: str) -> Option:
    if field.default_factory is not dataclasses.MISSING:
        default: Any = field.default_factory()
    else:
        default = field.default
    if isinstance(default, tuple):
        shown = " ".join(str(value) for value in default)  # empty: none given
    else:
        shown = str(default)
    return Option(flag, metavar(hint), shown, _joined(doc), key)


def metavar(hint: Any) -> str:
    """A short word for the values an option of type ``hint`` takes."""
    hint = _bare(hint)
    origin = typing.get_origin(hint)
    arguments = typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        words = [metavar(a) for a in arguments if a is not type(None)]
        return "|".join(words) + ("|None" if type(None) in arguments else "")
    if origin is Literal:
        return "{" + ",".join(str(a) for a in arguments) + "}"
    if origin is tuple:
        if len(arguments) == 2 and arguments[1] is Ellipsis:
            return f"{metavar(arguments[0])}..."
        return " ".join(metavar(a) for a in arguments)
    names = {bool: "BOOL", int: "INT", float: "FLOAT", str: "STR"}
    return names.get(hint, "VALUE")


def field_docs(kind: type) -> dict[str, str]:
    """The description of each field of dataclass ``kind`` (and of its dataclass bases), where
    tyro reads them for its help: the docstring under the field, or the class docstring's
    ``Attributes:`` entry."""
    docs: dict[str, str] = {}
    for cls in reversed(kind.__mro__):
        if not dataclasses.is_dataclass(cls):
            continue
        docs.update(_attribute_docs(inspect.getdoc(cls) or ""))
        try:
            source = textwrap.dedent(inspect.getsource(cls))
        except (OSError, TypeError):
            continue
        tree = ast.parse(source)
        body = next((node.body for node in tree.body if isinstance(node, ast.ClassDef)), [])
        for statement, following in itertools.pairwise(body):
            if (
                isinstance(statement, ast.AnnAssign)
                and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[statement.target.id] = inspect.cleandoc(following.value.value)
    return docs


def _attribute_docs(doc: str) -> dict[str, str]:
    """The entries of a Google-style docstring's ``Attributes:`` section."""
    docs: dict[str, str] = {}
    lines = doc.splitlines()
    if "Attributes:" not in lines:
        return docs
    name = ""
    indent = -1
    for line in lines[lines.index("Attributes:") + 1 :]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if depth == 0:
            break  # the next section
        entry = re.match(r"(\w+)( \(.*?\))?: (.*)", line.strip())
        if entry and (indent < 0 or depth == indent):
            indent, name = depth, entry.group(1)
            docs[name] = entry.group(3)
        elif name:
            docs[name] += " " + line.strip()
    return docs


def _summary(kind: type) -> str:
    """The first sentence of a class's docstring (before any ``Attributes:`` section)."""
    doc = (inspect.getdoc(kind) or "").split("Attributes:", 1)[0]
    return first_sentence(_joined(doc))


def _joined(doc: str) -> str:
    """A docstring's paragraphs as one line each, blank lines kept between them: the hard
    line breaks of the source are not the text's."""
    paragraphs = re.split(r"\n\s*\n", doc.strip())
    return "\n\n".join(" ".join(part.split()) for part in paragraphs if part.strip())


def first_sentence(text: str) -> str:
    """The first sentence of ``text`` (a docstring joined by :func:`_joined`)."""
    first = text.split("\n\n", 1)[0]
    return _SENTENCE_END.split(first, 1)[0]


#: The most characters of a docstring's first sentence --help shows (two lines of help).
LONGEST = 130


def short_help(option: Option, name: str, longest: int = LONGEST) -> str:
    """The line --help gives an option (``name``: its flag without ``--``, ``_`` for ``-``):
    :data:`SHORT`'s, else its docstring's first sentence, cut at the last clause that ends
    within ``longest`` characters when it is longer."""
    if name in SHORT:
        return SHORT[name]
    sentence = first_sentence(option.doc)
    if len(sentence) <= longest:
        return sentence
    cuts = [sentence.rfind(mark, 20, longest - 4) for mark in ("; ", " (", ", ", ": ")]
    cut = max(cuts[:2]) if max(cuts[:2]) > 0 else max(cuts)
    if cut <= 0:
        cut = sentence.rfind(" ", 0, longest - 4)
    return sentence[:cut].rstrip(" ,;:") + " ..."


def train_help(width: int | None = None) -> str:
    """``lowcomm train --help``: usage, then each component's options, one short line each
    (wrapped to ``width``, the terminal's up to 100 columns by default), then where the
    details are."""
    if width is None:
        width = max(70, min(100, shutil.get_terminal_size((100, 24)).columns))
    column = 36
    lines = [
        "usage: lowcomm train [OPTIONS]",
        "       lowcomm train --config run.toml [OPTIONS]",
        "",
        "Train a model data-parallel with one lowcomm method. Each option is --name VALUE",
        "(defaults in brackets, BOOL: True or False); a method's own options are under its",
        "group at the end.",
    ]
    for group in groups():
        lines += ["", f"{group.title}:"]
        if group.note:
            lines += ["  " + line for line in textwrap.wrap(group.note, width - 2)]
        for option in group.options:
            name = option.flag.split()[0][2:].replace("-", "_")
            default = f" [{option.default}]" if option.default not in ("", "None") else ""
            longest = width - column - len(default) if group.brief else LONGEST
            text = short_help(option, name, longest) + default
            # "|None" left out: the option's line says what None means.
            head = f"  {option.flag} {option.metavar.removesuffix('|None')}".rstrip()
            wrapped = textwrap.wrap(text, width - column, break_on_hyphens=False) or [""]
            if len(head) <= column - 2:
                lines.append(head.ljust(column) + wrapped[0])
                rest = wrapped[1:]
            else:
                lines.append(head)
                rest = wrapped
            lines += [" " * column + line for line in rest]
    lines += ["", *FOOTER.splitlines()]
    return "\n".join(lines) + "\n"


def options_markdown() -> str:
    """docs/options.md: every option of ``lowcomm train`` with its whole description."""
    out = [
        "# `lowcomm train` options",
        "",
        "Every option of `lowcomm train`, grouped as `lowcomm train --help` groups them, with",
        "its whole description. `--help` shows one line of each. The same options are the",
        "keys of a config file ([config-files.md](config-files.md)).",
        "",
        "This page is generated from the source: `python -m lowcomm.options_help >",
        "docs/options.md` writes it again (a test checks that it is current).",
    ]
    for group in groups():
        out += ["", f"## {group.title}", ""]
        if group.note:
            out += [group.note, ""]
        for option in group.options:
            head = f"`{option.flag} {option.metavar}`" if option.metavar else f"`{option.flag}`"
            facts = [f"default `{option.default}`"] if option.default else []
            facts += [f"file key `{option.key}`"] if option.key else []
            default = f" ({'; '.join(facts)})" if facts else ""
            doc = option.doc.replace("\n\n", "\n\n  ")
            out.append(f"- {head}{default}: {doc}")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(options_markdown(), end="")
