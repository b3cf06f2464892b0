"""Communication: the ``Comm`` interface, its implementations, the network model and clocks.

Strategies talk to other workers only through a :class:`Comm`. ``TorchComm`` is imported
lazily so that importing this package never pulls in ``torch.distributed``.
"""

from __future__ import annotations

from lowcomm.comm.base import (
    CollectiveKind,
    Comm,
    CompletedHandle,
    Handle,
    ReduceOp,
    Role,
    payload_bytes,
)
from lowcomm.comm.clock import Clock, ClockKind, RealClock, VirtualClock, make_clock
from lowcomm.comm.emulated import NetworkComm
from lowcomm.comm.fake import CommCall, RecordingComm
from lowcomm.comm.local import LocalComm
from lowcomm.comm.network import PRESETS, NetworkProfile, bytes_sent
from lowcomm.comm.overlap import CommThread, FutureHandle, LaunchAgreement

__all__ = [
    "PRESETS",
    "Clock",
    "ClockKind",
    "CollectiveKind",
    "Comm",
    "CommCall",
    "CommThread",
    "CompletedHandle",
    "FutureHandle",
    "Handle",
    "LaunchAgreement",
    "LocalComm",
    "NetworkComm",
    "NetworkProfile",
    "RealClock",
    "RecordingComm",
    "ReduceOp",
    "Role",
    "VirtualClock",
    "bytes_sent",
    "make_clock",
    "payload_bytes",
]
