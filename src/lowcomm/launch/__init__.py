"""Launching workers: a local spawner for one machine, and ``torchrun`` for many.

Both end in the same place: an initialised ``torch.distributed`` process group and a call to
the same worker function.

Ports and addresses (local spawner): the rendezvous goes through a file store in a private
temporary directory (no listening socket), and Gloo's transport is pinned to the loopback
interface (``GLOO_SOCKET_IFNAME=lo``), so nothing listens beyond 127.0.0.1; Gloo picks its
ephemeral ports itself. Under ``torchrun`` the rendezvous is torchrun's own
(``--rdzv-backend c10d --rdzv-endpoint HOST:PORT``, 29400 by default).
"""

from __future__ import annotations

from lowcomm.launch.spawn import Interrupted, WorkerFailed, spawn_workers, under_torchrun

__all__ = ["Interrupted", "WorkerFailed", "spawn_workers", "under_torchrun"]
