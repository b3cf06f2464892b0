"""Declared faults: a trace of who fails, straggles and joins, and when.

A trace is text with one event per line; ``#`` starts a comment, blank lines are skipped::

    # when      worker    what
    step=40     worker=3  crash
    step=60     worker=3  join
    t=12.5      worker=1  slow factor=3 for=20
    t=30        link      factor=0.1 for=10
    t=45        link      down for=2

**When.** ``step=N`` (the run reaches optimizer step N) or ``t=SECONDS`` (on the run's clock,
modeled seconds on the virtual clock). An event *has happened* at its moment: a query at
step 40 already sees the crash at step 40.

**Who.** ``worker=K`` with ``0 <= K < M``, or ``link`` for an event of the shared link.

**What.**

* ``crash``: the worker stops and its state is lost.
* ``leave``: the worker stops and keeps its state (it may ``rejoin`` with it).
* ``join``: a new worker takes slot K, with fresh per-worker state (a replacement).
* ``rejoin``: the worker that left slot K comes back. After a crash there is nothing to come
  back with, so a crashed slot is filled by ``join``.
* ``slow factor=F [for=D]``: the worker's compute takes F times as long (F >= 1).
* ``link factor=F [for=D]``: the link's bandwidth is multiplied by F (0 < F <= 1).
* ``link down for=D``: no transfer moves for D.

**Durations.** ``for=`` counts in the unit of its event's moment: steps after ``step=``
(a whole number), seconds after ``t=``. One rule, so that a line reads the same whichever
clock it uses. An interval covers ``[start, start + D)``. Without ``for=`` a slowdown or a
degraded link lasts to the end of the run; a link down must say how long, since a link down
for good leaves no round able to finish. Overlapping slowdowns (or link factors) multiply.

**Order.** Membership events (crash, leave, join, rejoin) must all use one clock, so their
order is known before the run starts; slow and link events may use either. Parsing sorts the
events: those on steps by step, then those on time by time, events at the same moment in the
order of the file.

**Validation** against a run of M workers ends in one line naming the file, the line, its
text, the rule and the fix: a malformed line, an unknown word or key (with the closest known
one), worker 7 of 4, a join of a live worker or a crash of a dead one, and a trace that leaves
no worker alive at some moment.

Queries (:meth:`FaultTrace.members`, :meth:`FaultTrace.speed_factor`,
:meth:`FaultTrace.link_factor`, :meth:`FaultTrace.events_between`) are pure: they take the
run's position as ``step=`` and/or ``time=`` and read nothing else. A query must give the
clock of every event it could depend on; a trace whose events all use ``t=`` is queried by
time alone.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

__all__ = [
    "EVENT_KINDS",
    "MEMBERSHIP_KINDS",
    "Event",
    "EventKind",
    "FaultTrace",
    "TraceError",
    "load_trace",
    "parse_trace",
]

EventKind = Literal["crash", "leave", "join", "rejoin", "slow", "link_degraded", "link_down"]

#: Every event kind, in the order :meth:`FaultTrace.to_text` breaks ties in.
EVENT_KINDS: tuple[EventKind, ...] = (
    "crash",
    "leave",
    "join",
    "rejoin",
    "slow",
    "link_degraded",
    "link_down",
)
#: The kinds that change who is alive.
MEMBERSHIP_KINDS: frozenset[str] = frozenset({"crash", "leave", "join", "rejoin"})

_WORKER_WORDS = ("crash", "leave", "join", "rejoin", "slow")
_WORDS = (*_WORKER_WORDS, "link", "down")
_KEYS = ("step", "t", "worker", "factor", "for")
# Spellings difflib cannot reach from a one-letter key.
_KEY_HINTS = {"time": "t", "at": "t", "seconds": "t", "s": "step", "duration": "for"}


class TraceError(ValueError):
    """A fault trace that cannot run: the message is one line naming the file, the line,
    its text, the rule and the fix."""


@dataclass(frozen=True)
class Event:
    """One declared event.

    Attributes:
        kind: what happens (``link_degraded`` is written ``link factor=F``, ``link_down`` is
            written ``link down``).
        worker: the worker's slot, or None for a link event.
        at_step: the step it happens at, when the line says ``step=``.
        at_time: the time it happens at (seconds on the run's clock), when the line says ``t=``.
        factor: the slowdown (slow) or bandwidth multiplier (link_degraded); None otherwise.
        duration: how long a slow or link event lasts, in steps or seconds like its moment;
            None means to the end of the run.
        line: the line of the source it came from (0 when built in code); kept for messages,
            not compared.
        text: that line as written (whitespace collapsed, comment dropped; empty when built
            in code); kept for messages, not compared.
    """

    kind: EventKind
    worker: int | None
    at_step: int | None = None
    at_time: float | None = None
    factor: float | None = None
    duration: float | None = None
    line: int = field(default=0, compare=False)
    text: str = field(default="", compare=False, repr=False)

    @property
    def clock(self) -> Literal["step", "time"]:
        """``step`` when the event is placed by step, ``time`` when by time."""
        return "step" if self.at_step is not None else "time"

    @property
    def at(self) -> float:
        """The event's moment on its own clock."""
        if self.at_step is not None:
            return float(self.at_step)
        assert self.at_time is not None
        return self.at_time

    def to_text(self) -> str:
        """The event as one trace line (columns aligned like the hand-written example).

        A field the event lacks is left out rather than refused, so that a message about an
        invalid event can still quote it."""
        if self.at_step is not None:
            when = f"step={self.at_step}"
        else:
            when = "" if self.at_time is None else f"t={_number(self.at_time)}"
        who = "link" if self.worker is None else f"worker={self.worker}"
        words = {"link_degraded": [], "link_down": ["down"]}.get(self.kind, [self.kind])
        if self.factor is not None:
            words.append(f"factor={_number(self.factor)}")
        if self.duration is not None:
            words.append(f"for={_number(self.duration)}")
        return f"{when:<11} {who:<9} {' '.join(words)}"


def _number(value: float) -> str:
    # repr round-trips a float exactly; whole numbers print without ".0" to read like a person's.
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e15 else repr(value)


def _sort_key(event: Event) -> tuple[int, float]:
    if event.at_step is not None:
        return (0, float(event.at_step))
    # An event without a moment sorts last; validation then refuses it by name.
    return (1, math.inf if event.at_time is None else event.at_time)


@dataclass(frozen=True)
class FaultTrace:
    """A validated fault trace for a run of ``workers`` workers.

    Build one with :func:`parse_trace`, :func:`load_trace` or
    :func:`lowcomm.faults.generate.generate_trace`; constructing it directly sorts and
    validates ``events`` the same way.

    Attributes:
        workers: M, the run's number of worker slots; every slot is alive at the start.
        events: the events, sorted (see the module docstring).
        source: where the trace came from, for messages (a path, or ``<generated ...>``).
    """

    workers: int
    events: tuple[Event, ...]
    source: str = field(default="<trace>", compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise TraceError(
                f"{self.source}: workers={self.workers!r}: a run has at least one worker; "
                "pass the run's worker count"
            )
        ordered = tuple(sorted(self.events, key=_sort_key))
        object.__setattr__(self, "events", ordered)
        _validate(ordered, self.workers, self.source)

    # ---- queries -------------------------------------------------------------------------

    def members(self, *, step: int | None = None, time: float | None = None) -> tuple[int, ...]:
        """The workers alive at this moment, sorted.

        Args:
            step: the run's step (needed when membership events use ``step=``).
            time: the run's time in seconds (needed when they use ``t=``).

        Raises:
            ValueError: when the moment lacks the clock the membership events use.
        """
        alive = set(range(self.workers))
        for event in self.events:
            if event.kind in MEMBERSHIP_KINDS and _reached(event, step, time, "members"):
                assert event.worker is not None
                if event.kind in ("crash", "leave"):
                    alive.discard(event.worker)
                else:
                    alive.add(event.worker)
        return tuple(sorted(alive))

    def speed_factor(
        self, worker: int, *, step: int | None = None, time: float | None = None
    ) -> float:
        """How many times longer worker ``worker``'s compute takes at this moment (1.0 when
        it is not slowed; overlapping slowdowns multiply)."""
        if not 0 <= worker < self.workers:
            raise ValueError(
                f"worker={worker}: a run of {self.workers} workers has workers "
                f"0..{self.workers - 1}; ask about one of them"
            )
        factor = 1.0
        for event in self.events:
            if (
                event.kind == "slow"
                and event.worker == worker
                and _active(event, step, time, "speed_factor")
            ):
                assert event.factor is not None
                factor *= event.factor
        return factor

    def link_factor(self, *, step: int | None = None, time: float | None = None) -> float:
        """The link's bandwidth multiplier at this moment: 1.0 when healthy, 0.0 when down,
        the product of the active ``link factor=F`` events otherwise."""
        factor = 1.0
        for event in self.events:
            if event.kind in ("link_degraded", "link_down") and _active(
                event, step, time, "link_factor"
            ):
                if event.kind == "link_down":
                    return 0.0
                assert event.factor is not None
                factor *= event.factor
        return factor

    def events_between(
        self,
        *,
        since_step: int | None = None,
        until_step: int | None = None,
        since_time: float | None = None,
        until_time: float | None = None,
    ) -> tuple[Event, ...]:
        """The events that happen after ``since`` and at or before ``until`` (the interval
        ``(since, until]`` on each event's clock), in trace order.

        Raises:
            ValueError: when the trace has events on a clock whose bounds are not given.
        """
        found = []
        for event in self.events:
            if event.at_step is not None:
                if since_step is None or until_step is None:
                    raise ValueError(_missing_clock("events_between", "since_step/until_step"))
                inside = since_step < event.at_step <= until_step
            else:
                if since_time is None or until_time is None:
                    raise ValueError(_missing_clock("events_between", "since_time/until_time"))
                inside = since_time < event.at <= until_time
            if inside:
                found.append(event)
        return tuple(found)

    def membership_events(self) -> tuple[Event, ...]:
        """The crash, leave, join and rejoin events, in order."""
        return tuple(event for event in self.events if event.kind in MEMBERSHIP_KINDS)

    def to_text(self) -> str:
        """The trace as text that :func:`parse_trace` reads back to an equal trace."""
        lines = ["# when      worker    what"]
        lines.extend(event.to_text() for event in self.events)
        return "\n".join(lines) + "\n"


def _missing_clock(query: str, needed: str) -> str:
    return f"{query}: this trace has events placed on that clock; pass {needed} as well"


def _reached(event: Event, step: int | None, time: float | None, query: str) -> bool:
    if event.at_step is not None:
        if step is None:
            raise ValueError(_missing_clock(query, "step="))
        return event.at_step <= step
    if time is None:
        raise ValueError(_missing_clock(query, "time="))
    return event.at <= time


def _active(event: Event, step: int | None, time: float | None, query: str) -> bool:
    if not _reached(event, step, time, query):
        return False
    if event.duration is None:
        return True
    now = time if event.at_step is None else step
    assert now is not None
    return now < event.at + event.duration


# ---- validation ----------------------------------------------------------------------------


def _where(source: str, event: Event) -> str:
    line = f":{event.line}" if event.line else ""
    return f"{source}{line}: {event.text or ' '.join(event.to_text().split())!r}"


def _validate(events: tuple[Event, ...], workers: int, source: str) -> None:
    membership_clock: Event | None = None
    for event in events:
        _validate_event(event, workers, source)
        if event.kind in MEMBERSHIP_KINDS:
            if membership_clock is None:
                membership_clock = event
            elif membership_clock.clock != event.clock:
                first = membership_clock
                where = f"line {first.line}" if first.line else f"'{first.to_text().strip()}'"
                unit = "step=N" if first.clock == "step" else "t=SECONDS"
                raise TraceError(
                    f"{_where(source, event)}: crash, leave, join and rejoin must all use one "
                    f"clock so their order is known before the run, and {where} uses "
                    f"{first.clock}; write this one with {unit} too"
                )
    _validate_membership(events, workers, source)


def _validate_event(event: Event, workers: int, source: str) -> None:
    where = _where(source, event)
    if event.kind not in EVENT_KINDS:
        raise TraceError(f"{where}: unknown kind {event.kind!r}; use one of {EVENT_KINDS}")
    if (event.at_step is None) == (event.at_time is None):
        raise TraceError(f"{where}: an event has exactly one moment; give step= or t=")
    if event.at_step is not None and event.at_step < 0:
        raise TraceError(f"{where}: step={event.at_step} is negative; steps count from 0")
    if event.at_time is not None and not (math.isfinite(event.at_time) and event.at_time >= 0):
        raise TraceError(
            f"{where}: t={_number(event.at_time)} must be a finite time >= 0 in seconds"
        )
    if event.kind in ("link_degraded", "link_down"):
        if event.worker is not None:
            raise TraceError(f"{where}: a link event names no worker; drop worker=")
    elif event.worker is None:
        raise TraceError(f"{where}: a {event.kind} event needs worker=K (0 <= K < {workers})")
    elif not 0 <= event.worker < workers:
        raise TraceError(
            f"{where}: worker {event.worker} of {workers}: a run of {workers} workers has "
            f"workers 0..{workers - 1}; name one of them or run with more workers"
        )
    needs_factor = event.kind in ("slow", "link_degraded")
    if needs_factor and event.factor is None:
        example = "factor=3" if event.kind == "slow" else "factor=0.1"
        raise TraceError(f"{where}: a {_word(event.kind)} event needs factor=F; add e.g. {example}")
    if not needs_factor and event.factor is not None:
        raise TraceError(f"{where}: a {_word(event.kind)} event takes no factor=; drop it")
    if event.factor is not None:
        if event.kind == "slow" and not (math.isfinite(event.factor) and event.factor >= 1):
            raise TraceError(
                f"{where}: factor={_number(event.factor)} is how many times longer compute takes and "
                "must be >= 1; write factor=2 for half speed"
            )
        if event.kind == "link_degraded" and not 0 < event.factor <= 1:
            raise TraceError(
                f"{where}: factor={_number(event.factor)} multiplies the link's bandwidth and must be "
                "in (0, 1]; write 'link down for=D' for no bandwidth"
            )
    if event.kind in MEMBERSHIP_KINDS and event.duration is not None:
        raise TraceError(f"{where}: a {event.kind} event takes no for=; drop it")
    if event.kind == "link_down" and event.duration is None:
        raise TraceError(
            f"{where}: a link down for the rest of the run leaves no round able to finish; "
            "give for=D"
        )
    if event.duration is not None:
        if not (math.isfinite(event.duration) and event.duration > 0):
            raise TraceError(
                f"{where}: for={_number(event.duration)} must be a finite duration > 0; give "
                "for=D with D > 0, or drop for= to last to the end of the run"
            )
        if event.at_step is not None and not float(event.duration).is_integer():
            raise TraceError(
                f"{where}: for={_number(event.duration)} counts steps after step= and must be a whole "
                "number; place the event with t= to give it in seconds"
            )


def _word(kind: str) -> str:
    return {"link_degraded": "link factor", "link_down": "link down"}.get(kind, kind)


def _validate_membership(events: tuple[Event, ...], workers: int, source: str) -> None:
    alive = set(range(workers))
    crashed: set[int] = set()
    changes = [event for event in events if event.kind in MEMBERSHIP_KINDS]
    emptied_by: Event | None = None
    for index, event in enumerate(changes):
        worker = event.worker
        assert worker is not None
        where = _where(source, event)
        if event.kind in ("crash", "leave"):
            if worker not in alive:
                raise TraceError(
                    f"{where}: worker {worker} is not alive at this moment, so it cannot "
                    f"{event.kind}; join it before, or drop this line"
                )
            alive.discard(worker)
            if event.kind == "crash":
                crashed.add(worker)
            else:
                crashed.discard(worker)
            if not alive:
                emptied_by = event
        else:
            if worker in alive:
                raise TraceError(
                    f"{where}: worker {worker} is alive at this moment, so it cannot "
                    f"{event.kind}; crash or leave it before, or drop this line"
                )
            if event.kind == "rejoin" and worker in crashed:
                raise TraceError(
                    f"{where}: worker {worker} crashed and lost its state, so it cannot "
                    "rejoin with it; write join for a replacement"
                )
            alive.add(worker)
            crashed.discard(worker)
        # Events at one moment happen together: a crash and its replacement's join at the
        # same step leave the run a worker, whichever line comes first.
        moment_ends = index + 1 == len(changes) or changes[index + 1].at != event.at
        if moment_ends and not alive:
            assert emptied_by is not None
            when = (
                f"step {emptied_by.at_step}"
                if emptied_by.at_step is not None
                else (f"t={_number(emptied_by.at)}")
            )
            raise TraceError(
                f"{_where(source, emptied_by)}: no worker is alive from {when} on; a run needs "
                "one at every moment, so join or rejoin a worker by then, or drop this line"
            )


# ---- parsing -------------------------------------------------------------------------------


def _closest(word: str, known: tuple[str, ...]) -> str:
    if word in _KEY_HINTS and known is _KEYS:
        return f"; did you mean {_KEY_HINTS[word]!r}?"
    match = difflib.get_close_matches(word, known, n=1, cutoff=0.5)
    return f"; did you mean {match[0]!r}?" if match else f"; known: {', '.join(known)}"


def _split_tokens(text: str, where: str) -> tuple[dict[str, str], list[str]]:
    """A line's ``key=value`` pairs and its bare words, each known and given once."""
    values: dict[str, str] = {}
    words: list[str] = []
    for token in text.split():
        if "=" in token:
            key, _, value = token.partition("=")
            if key not in _KEYS:
                raise TraceError(f"{where}: unknown key {key!r}{_closest(key, _KEYS)}")
            if key in values:
                raise TraceError(f"{where}: {key}= is given twice; keep one")
            if not value:
                raise TraceError(f"{where}: {key}= has no value; write {key}=VALUE")
            values[key] = value
        else:
            if token not in _WORDS:
                raise TraceError(f"{where}: unknown word {token!r}{_closest(token, _WORDS)}")
            if token in words:
                raise TraceError(f"{where}: {token!r} is given twice; keep one")
            words.append(token)
    return values, words


def _parse_line(text: str, line: int, source: str) -> Event:
    where = f"{source}:{line}: {' '.join(text.split())!r}"
    values, words = _split_tokens(text, where)

    def number(key: str, kind: type[int] | type[float]) -> float | None:
        if key not in values:
            return None
        raw = values[key]
        try:
            value = kind(raw)
        except ValueError:
            noun = "a whole number" if kind is int else "a number"
            raise TraceError(f"{where}: {key}={raw} is not {noun}; write e.g. {key}=3") from None
        if not math.isfinite(value):
            raise TraceError(f"{where}: {key}={raw} is not finite; write a finite number")
        return value

    if ("step" in values) == ("t" in values):
        raise TraceError(
            f"{where}: an event needs exactly one moment; start the line with step=N or t=SECONDS"
        )
    at_step = number("step", int)
    at_time = number("t", float)
    worker = number("worker", int)
    factor = number("factor", float)
    duration = number("for", float)
    if "link" in words:
        others = [word for word in words if word not in ("link", "down")]
        if others:
            raise TraceError(
                f"{where}: {others[0]!r} is not a link event; a link line says "
                "'link factor=F for=D' or 'link down for=D'"
            )
        kind: EventKind = "link_down" if "down" in words else "link_degraded"
        if kind == "link_down" and factor is not None:
            raise TraceError(f"{where}: a link down takes no factor=; drop one of the two")
    else:
        if "down" in words:
            raise TraceError(f"{where}: 'down' is said of the link; write 'link down for=D'")
        if worker is None:
            raise TraceError(f"{where}: name who: worker=K, or link for a link event")
        if len(words) != 1:
            raise TraceError(
                f"{where}: say what happens, one of {', '.join(_WORKER_WORDS)}"
                + (f" (found {' '.join(words)})" if words else "")
            )
        kind = words[0]  # type: ignore[assignment]  # checked against _WORDS above
    return Event(
        kind=kind,
        worker=None if worker is None else int(worker),
        at_step=None if at_step is None else int(at_step),
        at_time=at_time,
        factor=factor,
        duration=duration,
        line=line,
        text=" ".join(text.split()),
    )


def parse_trace(text: str, *, workers: int, source: str = "<trace>") -> FaultTrace:
    """Parse and validate a trace for a run of ``workers`` workers.

    Args:
        text: the trace (see the module docstring for its format).
        workers: M, the run's number of workers.
        source: the name messages give the text (a path).

    Returns:
        The trace, its events sorted.

    Raises:
        TraceError: on the first problem, in one line.
    """
    events = []
    for line, raw in enumerate(text.splitlines(), start=1):
        content = raw.split("#", 1)[0]
        if content.strip():
            events.append(_parse_line(content, line, source))
    return FaultTrace(workers=workers, events=tuple(events), source=source)


def load_trace(path: str | Path, *, workers: int) -> FaultTrace:
    """Read and validate the trace file at ``path`` (see :func:`parse_trace`).

    Raises:
        TraceError: when the file cannot be read or the trace is not valid.
    """
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise TraceError(
            f"{path}: cannot read the fault trace ({error.strerror}); pass an existing file"
        ) from None
    except UnicodeDecodeError as error:
        raise TraceError(
            f"{path}: not a fault trace (byte {error.start} is not UTF-8 text); a trace is a "
            "text file of one event a line, e.g. 'step=40 worker=3 crash'"
        ) from None
    return parse_trace(text, workers=workers, source=str(path))
