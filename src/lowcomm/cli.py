"""``lowcomm``: the command line.

``lowcomm train`` runs one method on N local workers (or, started by ``torchrun``, joins the
job as one worker); ``lowcomm bench overhead`` compares lowcomm's DDP step with a plain
hand-written PyTorch loop; ``lowcomm methods`` lists the methods.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import tyro

# Imported where used, not here: `lowcomm train` starts the worker server before this
# process imports torch (lowcomm.config does), so that both imports run at once.
if TYPE_CHECKING:
    from lowcomm.config import TrainConfig
    from lowcomm.plan import PlanConfig


@dataclass(kw_only=True)
class MethodsCommand:
    """List the training methods."""


def _fail(message: str, code: int = 2) -> NoReturn:
    print(f"lowcomm: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def run_train(config: TrainConfig) -> None:
    """Run one training job through the launch path (:func:`lowcomm.launch.run.run_training`),
    turning its refusals into one-line errors and an interrupt into its exit status."""
    from lowcomm.launch import Interrupted, WorkerFailed
    from lowcomm.launch.run import run_training

    try:
        run_training(config)
    except ValueError as error:  # ConfigError and DataError: a refusal naming the fix
        _fail(str(error))
    except WorkerFailed as error:
        from lowcomm.launch.run import kept_state

        _fail(f"{error}; {kept_state(config)}", code=1)
    except Interrupted as interrupt:
        print(_interrupted_message(config, interrupt), file=sys.stderr)
        _exit_past_busy_workers(
            128 + interrupt.signum, threads=config.placement.workers_per_process > 1
        )
        raise SystemExit(128 + interrupt.signum) from None
    except KeyboardInterrupt:  # before the workers start (they have their own handling)
        print("lowcomm: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


def _exit_past_busy_workers(code: int, *, threads: bool = False) -> None:
    """End the process now, without finalizing the interpreter, when this process ran worker
    threads (``threads``: in-process workers) or threads other than this one are still alive
    after a stop (workers it gave up on, a helper of theirs still unwinding). Finalizing after
    a stop of worker threads can abort the process ("terminate called without an active
    exception", status -6) instead of exiting with ``code``, even with every Python thread
    already ended, so the alive threads alone do not tell. Everything the workers wrote is
    flushed and checkpoints are committed atomically, so nothing kept is lost."""
    from lowcomm.launch.inprocess import workers_alive

    if (
        threads
        or workers_alive()
        or any(
            thread.is_alive() and thread is not threading.main_thread()
            for thread in threading.enumerate()
        )
    ):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _interrupted_message(config: TrainConfig, interrupt: Exception) -> str:
    """One line: what stopped the run, and what its directory now holds."""
    if config.placement.membership == "torchft":  # (each worker's own directory)
        from lowcomm.membership.local import interrupted_message

        return interrupted_message(config, interrupt)
    from lowcomm.train.checkpoint import committed
    from lowcomm.train.rundir import run_directory

    run_dir = run_directory(config)
    try:
        steps = len((run_dir / "metrics.jsonl").read_text().splitlines())
    except (OSError, UnicodeDecodeError):
        steps = 0
    if steps == 0:
        return f"lowcomm: {interrupt} before the first step: every worker stopped"
    kept = committed(run_dir)
    if kept:
        state = (
            f"its newest checkpoint is {kept[-1].name}; continue with: lowcomm train --resume "
            f"{run_dir}"
        )
    else:
        state = "no checkpoint was written (--checkpoint-every N writes them)"
    return (
        f"lowcomm: {interrupt}: every worker stopped; {run_dir}/metrics.jsonl holds {steps} "
        f"steps, {state}"
    )


def _resume_defaults(args: list[str]) -> TrainConfig | None:
    """With ``--resume DIR``, the run's saved config.json supplies every default, so
    ``lowcomm train --resume DIR`` alone continues the run; options given override it."""
    import json

    from lowcomm.config import TrainConfig

    value: str | None = None
    for i, arg in enumerate(args):
        if arg == "--resume" and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--resume="):
            value = arg.split("=", 1)[1]
    if value is None or value in ("auto", "None"):
        return None
    path = Path(value) / "config.json"
    if not path.exists():
        return None  # validate() names the missing checkpoint
    try:
        saved = TrainConfig.from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError) as error:
        _fail(
            f"--resume: {path} is not a readable lowcomm config ({error}); pass the options again"
        )
    run = saved.run
    run.out, run.stop_after, run.resume, run.overwrite = None, None, value, False
    saved.run.init_from = None  # the checkpoint holds the weights; --init-from again is refused
    if not any(arg == "--tokenizer" or arg.startswith("--tokenizer=") for arg in args):
        _tokenizer_copy(saved, Path(value))
    if not any(arg == "--model.config" or arg.startswith("--model.config=") for arg in args):
        _model_config_copy(saved, Path(value))
    return saved


def _model_config_copy(saved: TrainConfig, run_dir: Path) -> None:
    """A resumed run's model config.json, when the file config.json names (an --init-from
    model's) has moved or is gone: the copy the run kept beside its checkpoints."""
    from lowcomm.train.rundir import MODEL_CONFIG_COPY

    model_config = saved.model.config
    copy = run_dir / MODEL_CONFIG_COPY
    if model_config is None or Path(model_config).expanduser().is_file() or not copy.is_file():
        return
    print(
        f"lowcomm: --model.config {model_config} is gone; resuming with the run's copy {copy}",
        file=sys.stderr,
    )
    saved.model.config = str(copy)


def _tokenizer_copy(saved: TrainConfig, run_dir: Path) -> None:
    """A resumed run's tokenizer, when the file config.json names has moved or is gone: the
    copy the run kept beside its checkpoints (the fingerprint names it by content)."""
    from lowcomm.train.rundir import TOKENIZER_COPY

    tokenizer = saved.data.tokenizer
    copy = run_dir / TOKENIZER_COPY
    if tokenizer is None or Path(tokenizer).expanduser().is_file() or not copy.is_file():
        return
    print(
        f"lowcomm: --tokenizer {tokenizer} is gone; resuming with the run's copy {copy}",
        file=sys.stderr,
    )
    saved.data.tokenizer = str(copy)


def _bare_switches(args: list[str], switches: tuple[str, ...] = ("--overwrite",)) -> list[str]:
    """``--overwrite`` alone means ``--overwrite True`` (the other booleans take a value)."""
    out: list[str] = []
    for i, arg in enumerate(args):
        out.append(arg)
        following = args[i + 1] if i + 1 < len(args) else None
        if arg in switches and (following is None or following.startswith("-")):
            out.append("True")
    return out


def _refuse_other_families(args: list[str], config: TrainConfig | PlanConfig) -> None:
    """Refuse an option of another method family's group (``--method co2
    --diloco.sync-every 2``): the method would ignore it, and the run (or plan) would not be
    the one asked for. The groups are the methods' own declarations (``options_field``)."""
    from lowcomm.strategies import STRATEGIES
    from lowcomm.strategies.option_groups import group_members

    method = config.method
    if method not in STRATEGIES:
        return  # validate() names the unknown method
    own = STRATEGIES[method].options_field
    members = group_members(STRATEGIES)
    for arg in args:
        if not arg.startswith("--"):
            continue
        flag = arg.split("=", 1)[0]
        family, dot, option = flag[2:].partition(".")
        if not dot or family not in members or family == own:
            continue
        which = f"an option of {', '.join(members[family])}, not of --method {method}"
        if own is None:
            fix = f"--method {method} takes no method options; drop it"
        else:
            options = {f.name.replace("_", "-") for f in dataclasses.fields(getattr(config, own))}
            same = option.replace("_", "-")
            fix = (
                f"--method {method} takes --{own}.* options: use --{own}.{same}, or drop it"
                if same in options
                else f"--method {method} takes --{own}.* options; drop it"
            )
        _fail(f"{flag}: {which}; {fix}")


def _refuse_given_twice(args: list[str], names: tuple[str, ...]) -> None:
    """Refuse ``--steps 10 --train.steps 20``: a top-level option that is also a ``--train.``
    option is one option, and neither value may silently win."""
    given = {arg.split("=", 1)[0] for arg in args if arg.startswith("--")}
    for name in names:
        flag = f"--{name.replace('_', '-')}"
        if flag in given and f"--train.{flag[2:]}" in given:
            _fail(
                f"{flag}: given both as {flag} and as --train.{flag[2:]}; they are one option, give it once"
            )


def run_methods() -> None:
    """One entry per method: its name and the first paragraph of its docstring, wrapped to
    the terminal (never cut mid-phrase)."""
    import shutil
    import textwrap

    from lowcomm.strategies import STRATEGIES

    width = max(60, min(120, shutil.get_terminal_size((100, 24)).columns))
    for name, cls in sorted(STRATEGIES.items()):
        first = (cls.__doc__ or "").strip().split("\n\n")[0]
        summary = " ".join(line.strip() for line in first.splitlines())
        print(
            textwrap.fill(
                summary,
                width=width,
                initial_indent=f"{name:20s} ",
                subsequent_indent=" " * 21,
                break_on_hyphens=False,
            )
        )


USAGE = """usage: lowcomm {demo,train,eval,generate,bench,plan,reproduce,methods,selftest} [OPTIONS]
       lowcomm --version

  demo      DDP against DiLoCo over a WAN link on the same tokens, with a verdict (~3 min)
  train     train a model data-parallel with one method (lowcomm train --help)
  eval      validation loss and perplexity of a saved model (lowcomm eval OUT)
  generate  sample text from a saved model (lowcomm generate OUT --prompt TEXT)
  bench     benchmarks: overhead ratio, method comparison, clock under load, scale, fsdp, faults (lowcomm bench --help)
  plan      predict time, bytes and memory of a method at any scale (lowcomm plan --help)
  reproduce run the papers' CPU-scale experiments, judge their claims (lowcomm reproduce --help)
  methods   list the training methods
  selftest  check this machine's devices, collectives and methods first (--device cuda)
"""


class _OptionError(Exception):
    """An option dataclass rejected its value while the command line was parsed."""


def _one_line_option_errors() -> contextlib.AbstractContextManager[object]:
    """Make a value that an option rejects a one-line error naming the option.

    Covers an options dataclass's own validation, a value of the wrong type (``--workers
    two``), a value outside an option's choices, a wrong number of values and an unknown
    option (with the closest known one: :func:`unrecognized_options`). tyro reports
    these in a multi-line box; its hook to take over is not public API yet, so this degrades
    to tyro's own box (still exit code 2) if the hook moves.
    """
    try:
        from tyro._errors import (
            BadValue,
            InstantiationFailure,
            InvalidChoice,
            MissingArgs,
            UnrecognizedArgs,
            on_parse_error,
        )
    except ImportError:
        return contextlib.nullcontext()

    def flag(argument: object) -> str:
        flags = getattr(getattr(argument, "lowered", None), "name_or_flags", None) or ("option",)
        return str(flags[0])

    def named(argument: object, message: str) -> str:
        first = message.strip().splitlines()[0] if message.strip() else "invalid value"
        # Our own validation already starts with the option's flag.
        return first if first.startswith("--") else f"{flag(argument)}: {plain(first)}"

    def hook(event: object) -> None:
        if isinstance(event, UnrecognizedArgs):
            raise _OptionError(unrecognized_options(str(event.prog), list(event.tokens)))
        if isinstance(event, (MissingArgs, BadValue)):
            # A typo in an option's name also shows as the value it was meant for missing:
            # name the typo, which is the cause.
            unknown = _unknown_options(str(event.prog))
            if unknown:
                raise _OptionError(unrecognized_options(str(event.prog), unknown))
        if isinstance(event, MissingArgs):
            prog = str(event.prog)
            missing = ", ".join(flag(getattr(a, "arg", a)) for a in event.missing_arguments)
            raise _OptionError(f"{prog}: missing {missing} (required); `{prog} --help` says more")
        if isinstance(event, InstantiationFailure):
            raise _OptionError(named(event.argument, str(event.message)))
        if isinstance(event, InvalidChoice):
            choices = ", ".join(str(choice) for choice in event.choices)
            raise _OptionError(f"{flag(event.argument)}: {event.value!r} is not one of {choices}")
        if isinstance(event, BadValue):
            # The reason is a code such as "too_few_values".
            raise _OptionError(named(event.argument, str(event.reason).replace("_", " ")))

    return on_parse_error(hook)


#: Python's words for a value that is not a number, and ours.
_CONVERSIONS = (
    (re.compile(r"^invalid literal for int\(\) with base 10: (.+)$"), "{} is not a whole number"),
    (re.compile(r"^could not convert string to float: (.+)$"), "{} is not a number"),
    # (An optional number: tyro tries None, then the number.)
    (
        re.compile(r"^no type matching \{None\}\|INT could be instantiated from \[(.+)\]\.?$"),
        "{} is not a whole number (nor None, for unset)",
    ),
    (
        re.compile(r"^no type matching \{None\}\|FLOAT could be instantiated from \[(.+)\]\.?$"),
        "{} is not a number (nor None, for unset)",
    ),
    (
        re.compile(r"^Could not find valid parse for arguments: \[(.+)\]$"),
        "cannot read the values {}",
    ),
)


def plain(message: str) -> str:
    """A conversion error of Python's (``invalid literal for int() with base 10: 'two'``) in
    words (``'two' is not a whole number``); any other message as it is."""
    for pattern, words in _CONVERSIONS:
        found = pattern.match(message)
        if found:
            return words.format(found.group(1))
    return message


def unrecognized_options(prog: str, tokens: list[str]) -> str:
    """The one-line error for command-line tokens ``prog`` does not know: each unknown option
    with the closest known one, if any is close, and where the options are listed."""
    import difflib

    if prog == "lowcomm bench":  # tyro names no benchmark: the command line does
        chosen = [word for word in _command_line[1:2] if word in _bench_names()]
        prog = " ".join([prog, *chosen])
    flags = {cls: option_flags(cls) for cls in _option_classes(prog)}
    known = [flag for listed in flags.values() for flag in listed] + _own_flags(prog)
    options = [token for token in tokens if token.startswith("-")]
    if not options:
        return f"{prog}: unexpected argument {tokens[0]!r} (options take the form --name value)"
    named = []
    for option in options:
        name = option.split("=", 1)[0]
        owners = [cls for cls, listed in flags.items() if name in listed]
        if owners:  # `lowcomm bench --repeats 2`: an option of a benchmark, none named
            which = ", ".join(_bench_name(cls) for cls in owners)
            named.append(f"{name} (an option of lowcomm bench {which}: name the benchmark first)")
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        named.append(f"{name} (did you mean {close[0]}?)" if close else name)
    noun = "option" if len(named) == 1 else "options"
    return f"{prog}: unknown {noun} {', '.join(named)}; `{prog} --help` lists them"


def _unknown_options(prog: str) -> list[str]:
    """The options on the command line being parsed that ``prog`` does not know."""
    known = {flag for cls in _option_classes(prog) for flag in option_flags(cls)}
    if not known:
        return []
    known.update(_own_flags(prog))
    given = [token.split("=", 1)[0] for token in _command_line if token.startswith("--")]
    return [name for name in given if name not in known and name != "--help"]


def option_flags(cls: type, prefix: str = "") -> list[str]:
    """The command-line flags tyro makes of an options dataclass (nested dataclasses as
    ``--outer.inner-name``)."""
    import typing

    hints = typing.get_type_hints(cls, include_extras=True)
    flags: list[str] = []
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if not field.init:
            continue
        name = prefix + field.name.replace("_", "-")
        hint = hints.get(field.name)
        extras: tuple[object, ...] = ()
        if typing.get_origin(hint) is typing.Annotated:
            hint, *rest = typing.get_args(hint)
            extras = tuple(rest)
        if tyro.conf.Positional in extras:
            continue
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            # (a group renamed on the command line: membership_options is --membership.*)
            renamed = [getattr(e, "name", None) for e in extras if getattr(e, "name", None)]
            if renamed:
                name = prefix + str(renamed[0]).replace("_", "-")
            if tyro.conf.OmitArgPrefixes in extras:
                inner = ""
            elif any(getattr(extra, "name", None) == "" for extra in extras):
                inner = prefix  # tyro.conf.arg(name=""): this level adds no prefix
            else:
                inner = name + "."
            flags += option_flags(hint, inner)
        else:
            flags.append(f"--{name}")
    return flags


def _own_flags(prog: str) -> list[str]:
    """The options of ``prog`` that the command line reads itself, not its dataclass."""
    return list(TRAIN_FILE_OPTIONS) if prog == "lowcomm train" else []


def _bench_names() -> list[str]:
    from lowcomm.bench import BENCHMARKS

    return list(BENCHMARKS)


def _bench_name(cls: type) -> str:
    from lowcomm.bench import BENCHMARKS

    return next(name for name, bench in BENCHMARKS.items() if bench is cls)


#: The arguments after ``lowcomm`` being parsed (tyro's error events name ``lowcomm bench``
#: without the benchmark).
_command_line: list[str] = []


def _option_classes(prog: str) -> list[type]:
    """The options dataclasses of the command ``prog`` names (``lowcomm train``, ...)."""
    words = prog.split()[1:]
    command = words[0] if words else ""
    if command == "bench":
        from lowcomm.bench import BENCHMARKS

        chosen = [BENCHMARKS[w] for w in words[1:2] if w in BENCHMARKS]
        return chosen or list(BENCHMARKS.values())
    if command in ("train", "plan"):
        from lowcomm.config import TrainConfig
        from lowcomm.plan import PlanConfig

        return [TrainConfig if command == "train" else PlanConfig]
    if command == "reproduce":
        from lowcomm.reproduce import ReproduceConfig

        return [ReproduceConfig]
    if command in ("eval", "generate"):
        from lowcomm.use import EvalConfig, GenerateConfig

        return [EvalConfig if command == "eval" else GenerateConfig]
    if command == "selftest":
        from lowcomm.selftest import SelftestConfig

        return [SelftestConfig]
    if command == "demo":
        from lowcomm.demo import DemoConfig

        return [DemoConfig]
    return []


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    with _one_line_option_errors():
        try:
            _main(argv)
        except _OptionError as error:
            _fail(str(error))
        except BrokenPipeError:
            # `lowcomm methods | head`: the reader left; leave quietly as other tools do.
            import os

            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise SystemExit(141) from None


def _main(argv: list[str] | None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        raise SystemExit(0 if args else 2)
    if args[0] in ("-V", "--version"):
        from lowcomm import __version__

        print(f"lowcomm {__version__}")
        return
    command, rest = args[0], args[1:]
    _command_line[:] = args
    handler = _COMMANDS.get(command)
    if handler is None:
        _fail(
            f"unknown command {command!r}; choose demo, train, eval, generate, bench, plan, "
            f"reproduce, methods or selftest"
        )
    try:
        handler(rest)
    except ValueError as error:
        # Raised by a config dataclass's own validation while the options were parsed.
        _fail(str(error))


#: tyro's settings for every command: flags are written as their options are (no --no-x).
_TYRO = (tyro.conf.FlagConversionOff,)


def _in_this_process(rest: list[str], config_file: str | None = None) -> bool:
    """Whether the command line (or the --config file it names) puts the workers in this
    process (--workers-per-process > 1), which then starts no worker server."""
    for index, arg in enumerate(rest):
        if arg.startswith("--workers-per-process="):
            return arg.split("=", 1)[1] != "1"
        if arg == "--workers-per-process" and index + 1 < len(rest):
            return rest[index + 1] != "1"
    if config_file is not None:
        from lowcomm.config_file import peek

        return peek(config_file, "placement", "workers_per_process") not in (None, 1)
    return False


#: Options of `lowcomm train` that are not TrainConfig's fields: the command line's own.
TRAIN_FILE_OPTIONS = ("--config", "--print-config")


def _config_file_options(rest: list[str]) -> tuple[list[str], str | None, bool]:
    """``rest`` without ``--config FILE`` and ``--print-config``, the file named (None
    without one) and whether the config is to be printed instead of run."""
    left: list[str] = []
    config_file: str | None = None
    print_config = False
    index = 0
    while index < len(rest):
        arg = rest[index]
        if arg == "--print-config":
            print_config = True
        elif arg == "--config":
            if index + 1 == len(rest) or rest[index + 1].startswith("--"):
                _fail("--config: needs a file: --config run.toml (or a run directory)")
            if config_file is not None:
                _fail(f"--config: given twice ({config_file}, {rest[index + 1]}); give one file")
            config_file = rest[index + 1]
            index += 1
        elif arg.startswith("--config="):
            config_file = arg.split("=", 1)[1]
        else:
            left.append(arg)
        index += 1
    return left, config_file, print_config


def _file_defaults(config_file: str, rest: list[str]) -> TrainConfig:
    """The TrainConfig a --config file holds, as the defaults the command line overrides."""
    from lowcomm.config_file import ConfigFileError, read_config

    if any(arg == "--resume" or arg.startswith("--resume=") for arg in rest) and (
        _resume_defaults(rest) is not None
    ):
        _fail(
            f"--config {config_file}: with --resume DIR the run's own config.json supplies the "
            f"options; drop --config (or pass --resume auto)"
        )
    try:
        return read_config(config_file)
    except ConfigFileError as error:
        _fail(str(error))


def _train_command(rest: list[str]) -> None:
    rest, config_file, print_config = _config_file_options(rest)
    if {"-h", "--help"} & set(rest):
        from lowcomm.options_help import train_help

        print(train_help(), end="")
        raise SystemExit(0)
    if not print_config and not _in_this_process(rest, config_file):
        from lowcomm.prestart import start_forkserver

        start_forkserver()
    from lowcomm.config import TrainConfig

    rest = _bare_switches(rest, ("--overwrite", "--tensorboard"))
    if config_file is not None:
        defaults: TrainConfig | None = _file_defaults(config_file, rest)
    else:
        defaults = _resume_defaults(rest)
    if defaults is None:
        train = tyro.cli(TrainConfig, args=rest, prog="lowcomm train", config=_TYRO)
    else:
        train = tyro.cli(
            TrainConfig, args=rest, prog="lowcomm train", config=_TYRO, default=defaults
        )
    _refuse_other_families(rest, train)
    if config_file is not None:
        _refuse_file_groups(train, config_file)
    if print_config:
        _print_config(train)
        return
    run_train(train)


def _refuse_file_groups(train: TrainConfig, config_file: str) -> None:
    from lowcomm.config_file import ConfigFileError, other_groups_set

    try:
        other_groups_set(train, config_file)
    except ConfigFileError as error:
        _fail(str(error))


def _print_config(train: TrainConfig) -> None:
    """Write the TOML of the options given to stdout, checked as a run would check them
    first (:meth:`TrainConfig.validate`), so a file that would be refused is not written."""
    from lowcomm.config_file import to_toml

    train.validate()  # a ConfigError is a ValueError: _main makes it one line
    print(to_toml(train), end="")


def _plan_command(rest: list[str]) -> None:
    from lowcomm.plan import PlanConfig, run_plan

    # train's flag style (the method options are train's own); `--json` alone is a switch.
    rest = _bare_switches(rest, ("--json",))
    plan = tyro.cli(PlanConfig, args=rest, prog="lowcomm plan", config=_TYRO)
    _refuse_other_families(rest, plan)
    run_plan(plan)


def _reproduce_command(rest: list[str]) -> None:
    from lowcomm.reproduce import ReproduceConfig, run_reproduce

    run_reproduce(tyro.cli(ReproduceConfig, args=rest, prog="lowcomm reproduce", config=_TYRO))


def _eval_command(rest: list[str]) -> None:
    from lowcomm.use import EvalConfig, run_eval

    run_eval(tyro.cli(EvalConfig, args=rest, prog="lowcomm eval", config=_TYRO))


def _generate_command(rest: list[str]) -> None:
    from lowcomm.use import GenerateConfig, run_generate

    run_generate(tyro.cli(GenerateConfig, args=rest, prog="lowcomm generate", config=_TYRO))


def _methods_command(rest: list[str]) -> None:
    tyro.cli(MethodsCommand, args=rest, prog="lowcomm methods")
    run_methods()


def _bench_command(rest: list[str]) -> None:
    from lowcomm.bench import BENCHMARKS, run_bench

    if rest[:1] == ["compare"]:
        from lowcomm.bench.compare import SHARED_DEFAULTS

        _refuse_given_twice(rest[1:], tuple(SHARED_DEFAULTS))
    run_bench(
        tyro.extras.subcommand_cli_from_dict(
            BENCHMARKS, args=rest, prog="lowcomm bench", config=_TYRO
        )
    )


def _selftest_command(rest: list[str]) -> None:
    from lowcomm.selftest import SelftestConfig, run_selftest

    selftest = tyro.cli(SelftestConfig, args=rest, prog="lowcomm selftest", config=_TYRO)
    raise SystemExit(run_selftest(selftest))


def _demo_command(rest: list[str]) -> None:
    from lowcomm.demo import DemoConfig, run_demo
    from lowcomm.launch import Interrupted

    demo = tyro.cli(DemoConfig, args=rest, prog="lowcomm demo", config=_TYRO)
    try:
        run_demo(demo)
    except Interrupted as interrupt:
        print(
            f"lowcomm: demo {interrupt}: the finished runs in {demo.out} are kept; the same "
            f"command again reuses them and runs the rest",
            file=sys.stderr,
        )
        # (the demo's workers are threads of this process, as in run_train's in-process case)
        _exit_past_busy_workers(128 + interrupt.signum, threads=True)
        raise SystemExit(128 + interrupt.signum) from None
    except RuntimeError as failed:  # a run failed (its error is in the report)
        _fail(str(failed), code=1)


#: What each command runs, on the arguments after its name.
_COMMANDS: dict[str, Callable[[list[str]], None]] = {
    "demo": _demo_command,
    "train": _train_command,
    "plan": _plan_command,
    "reproduce": _reproduce_command,
    "eval": _eval_command,
    "generate": _generate_command,
    "methods": _methods_command,
    "bench": _bench_command,
    "selftest": _selftest_command,
}
