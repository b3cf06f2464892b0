"""The key prefix under which the workers of one torchrun rendezvous meet in the agent's store.

torchrun's agents share one TCP store across rendezvous rounds, so the keys a dead group wrote
(its Gloo and NCCL addresses) are still there when the next group starts. Each group must
therefore meet under a prefix no earlier group used, and every member of the group must pick
the same one. ``TORCHELASTIC_RESTART_COUNT`` is not such a prefix: an agent whose own worker
failed counts a restart, one that re-joined on a membership change does not, so the members of
one new group can hold different counts and wait on each other's keys until the store times
out, or read a dead group's addresses.

:func:`agree_generation` makes the prefix from the store alone: rank 0 of the new group draws
a generation number no earlier rank 0 drew (an atomic counter), and hands it to each other rank
in answer to a nonce that rank drew for this start, so no rank can take a dead group's answer
for its own.

Gloo (the bookkeeping group, and the whole group on the CPU) binds the interface
:func:`set_gloo_interface` chooses, as the local spawner pins loopback for its workers.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Mapping, MutableMapping
from typing import Any

#: The store keys of the agreement (under the agent's store, beside the groups' prefixes).
GENERATION_KEY = "lowcomm/generation"

#: Seconds between polls of the store while waiting, and between a rank's re-announcements.
_POLL_S = 0.05
_REANNOUNCE_S = 1.0


class RendezvousTimeout(RuntimeError):
    """A rank of the new group did not take part in the agreement in time."""


def _hello(rank: int) -> str:
    return f"lowcomm/hello/{rank}"


def _answer(rank: int) -> str:
    return f"lowcomm/answer/{rank}"


def agree_generation(store: Any, rank: int, world_size: int, timeout_s: float) -> int:
    """The generation number every rank of this group returns, new to the store.

    Rank 0 takes the next value of :data:`GENERATION_KEY`, clears every rank's announcement
    (the ones left there are a dead group's: its workers all stopped before this rendezvous),
    then answers each announcement that appears with ``"<nonce> <generation>"``. Every other
    rank announces a fresh nonce, again every second (rank 0 may clear one written before it
    started), until the answer to its own nonce appears.

    Args:
        store: the agent's store (a ``torch.distributed.Store``: ``add``, ``set``, ``get``,
            ``check``, ``delete_key``).
        rank, world_size: this process's place in the new group.
        timeout_s: how long to wait for the other ranks (or rank 0) before giving up.

    Raises:
        RendezvousTimeout: naming the ranks that never took part.
    """
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        generation = int(store.add(GENERATION_KEY, 1))
        for other in range(1, world_size):
            store.delete_key(_hello(other))
        waiting = set(range(1, world_size))
        while waiting:
            for other in sorted(waiting):
                if store.check([_hello(other)]):
                    nonce = bytes(store.get(_hello(other))).decode()
                    store.set(_answer(other), f"{nonce} {generation}")
                    waiting.discard(other)
            if waiting and time.monotonic() > deadline:
                raise RendezvousTimeout(
                    f"rank 0: ranks {', '.join(map(str, sorted(waiting)))} of this rendezvous "
                    f"did not announce themselves within {timeout_s:.0f} s "
                    f"(--collective-timeout-s); check that their processes started"
                )
            time.sleep(_POLL_S)
        return generation
    nonce = uuid.uuid4().hex
    while True:
        store.set(_hello(rank), nonce)
        until = time.monotonic() + _REANNOUNCE_S
        while time.monotonic() < until:
            if store.check([_answer(rank)]):
                answered, _, given = bytes(store.get(_answer(rank))).decode().partition(" ")
                if answered == nonce:
                    return int(given)
            time.sleep(_POLL_S)
        if time.monotonic() > deadline:
            raise RendezvousTimeout(
                f"rank {rank}: rank 0 of this rendezvous did not answer within "
                f"{timeout_s:.0f} s (--collective-timeout-s); check that its process started"
            )


def _interface_of(address: str) -> str | None:
    """The name of the network interface holding the IPv4 ``address`` (Linux; None
    elsewhere, or when no interface holds it)."""
    try:
        import fcntl
        import struct
    except ImportError:
        return None
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                request = struct.pack("256s", name.encode()[:15])
                reply = fcntl.ioctl(probe.fileno(), siocgifaddr, request)
            except OSError:
                continue  # an interface without an IPv4 address
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    return None


def route_interface(host: str, port: int = 9) -> str | None:
    """The interface this machine's route to ``host`` leaves through (None if the host does
    not resolve or the interface cannot be named). Nothing is sent: connecting a UDP socket
    only picks the route."""
    try:
        address = socket.gethostbyname(host)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, port))
            local = probe.getsockname()[0]
    except OSError:
        return None
    return _interface_of(local)


def _nccl_interfaces(value: str) -> str | None:
    """The interfaces of this machine an ``NCCL_SOCKET_IFNAME`` selects, comma-separated, as
    Gloo takes them: NCCL reads each name as a prefix (``=name``: exactly), Gloo only exact
    names. None for an exclusion (``^...``) or when nothing here matches."""
    value = value.strip()
    if not value or value.startswith("^"):
        return None
    exact = value.startswith("=")
    wanted = [name.strip() for name in value.lstrip("=").split(",") if name.strip()]
    present = [name for _, name in socket.if_nameindex()]
    chosen = [
        name
        for name in present
        if any(name == w or (not exact and name.startswith(w)) for w in wanted)
    ]
    return ",".join(chosen) or None


def choose_gloo_interface(environ: Mapping[str, str]) -> tuple[str, str] | None:
    """The interface Gloo should bind on this node, and why: ``GLOO_SOCKET_IFNAME`` as set;
    else ``NCCL_SOCKET_IFNAME`` where it names interfaces (not an exclusion, ``^...``); else
    the one the route to ``MASTER_ADDR`` leaves through. None when none can be told (Gloo
    then binds the address the host name resolves to, which can be 127.0.1.1)."""
    if environ.get("GLOO_SOCKET_IFNAME"):
        return environ["GLOO_SOCKET_IFNAME"], "GLOO_SOCKET_IFNAME, as set"
    nccl = _nccl_interfaces(environ.get("NCCL_SOCKET_IFNAME", ""))
    if nccl:
        return nccl, "NCCL_SOCKET_IFNAME"
    master = environ.get("MASTER_ADDR")
    if master:
        name = route_interface(master, int(environ.get("MASTER_PORT", "9") or 9))
        if name is not None:
            return name, f"the route to MASTER_ADDR {master}"
    return None


def set_gloo_interface(environ: MutableMapping[str, str] | None = None) -> str:
    """Set ``GLOO_SOCKET_IFNAME`` (:func:`choose_gloo_interface`) before any Gloo group is
    made, and return the line that says which interface was chosen and why."""
    env = os.environ if environ is None else environ
    chosen = choose_gloo_interface(env)
    if chosen is None:
        return (
            "Gloo interface: none could be told (no GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME or "
            "route to MASTER_ADDR); Gloo binds the host name's address, so set "
            "GLOO_SOCKET_IFNAME if the nodes cannot connect"
        )
    name, reason = chosen
    env["GLOO_SOCKET_IFNAME"] = name
    return f"Gloo interface: {name} ({reason})"


__all__ = [
    "GENERATION_KEY",
    "RendezvousTimeout",
    "agree_generation",
    "choose_gloo_interface",
    "route_interface",
    "set_gloo_interface",
]
