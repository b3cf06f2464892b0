"""torchrun's rendezvous, as lowcomm's workers meet in the agent's store: every group meets
under a prefix its members agree on, whatever restart counts their agents give them and
whatever earlier groups left in the store. Loopback only, bounded timeouts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from lowcomm.launch.rendezvous import (
    GENERATION_KEY,
    RendezvousTimeout,
    agree_generation,
    choose_gloo_interface,
    set_gloo_interface,
)

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _agree_all(store: dist.Store, world: int, timeout_s: float = 20.0) -> list[int]:
    results: list[int] = [0] * world
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = agree_generation(store, rank, world, timeout_s)
        except BaseException as error:  # (reported below)
            errors.append(error)

    threads = [threading.Thread(target=run, args=(r,)) for r in reversed(range(world))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 10)
    assert not errors, errors
    return results


def test_every_rank_takes_rank_0s_new_generation_over_a_dead_groups_answers() -> None:
    store = dist.HashStore()  # type: ignore[attr-defined]
    first = _agree_all(store, 3)
    assert first == [1, 1, 1]
    # A dead group's announcements and answers are still in the store; a later group (of
    # another size) agrees on a generation no earlier group used.
    store.set("lowcomm/answer/1", "stale-nonce 7")
    store.set("lowcomm/hello/2", "stale-nonce")
    assert _agree_all(store, 2) == [2, 2]
    assert _agree_all(store, 4) == [3, 3, 3, 3]
    assert int(store.add(GENERATION_KEY, 0)) == 3


def test_a_rank_that_never_comes_is_named_in_bounded_time() -> None:
    store = dist.HashStore()  # type: ignore[attr-defined]
    with pytest.raises(RendezvousTimeout, match=r"rank 0: ranks 1 of this rendezvous"):
        agree_generation(store, 0, 2, timeout_s=0.3)
    with pytest.raises(RendezvousTimeout, match=r"rank 1: rank 0 of this rendezvous"):
        agree_generation(store, 1, 2, timeout_s=0.3)


_WORKER = """
import os, sys, torch, torch.distributed as dist
from lowcomm.launch.spawn import init_from_env
init_from_env(device="cpu", timeout_s=5.0)
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"sum {t.item():g}", flush=True)
sys.stdout.flush()
os._exit(0)  # like a killed group: no teardown, its keys stay in the agent's store
"""


@pytest.mark.slow
def test_groups_meet_though_their_restart_counts_differ_again_and_again(tmp_path: Path) -> None:
    """Four groups in turn on one agent store (as torchrun's agents share theirs), each pair of
    workers given diverging restart counts, as two agents give them when one restarted for its
    worker's failure and the other for the membership change: every group trains."""
    agent = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    for counts in ((0, 0), (1, 0), (1, 2), (3, 2)):
        env = {
            **os.environ,
            "PYTHONPATH": SRC,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(agent.port),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "OMP_NUM_THREADS": "1",
        }
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            env.pop(name, None)  # Gloo's interface: the route to MASTER_ADDR, loopback
        workers = [
            subprocess.Popen(
                [sys.executable, "-c", _WORKER],
                env={**env, "RANK": str(rank), "TORCHELASTIC_RESTART_COUNT": str(count)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank, count in enumerate(counts)
        ]
        outputs = []
        for worker in workers:
            try:
                out, err = worker.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                for w in workers:
                    w.kill()
                    w.communicate()
                pytest.fail(f"restart counts {counts}: the group never met")
            outputs.append((worker.returncode, out, err[-2000:]))
        for code, out, err in outputs:
            assert code == 0 and "sum 3" in out, (counts, code, out, err)
            assert "Gloo interface: lo (the route to MASTER_ADDR 127.0.0.1)" in err, err


def test_gloo_takes_nccls_interfaces_or_the_route_to_the_master() -> None:
    present = [name for _, name in socket.if_nameindex()]
    assert "lo" in present
    assert choose_gloo_interface({"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "x"}) == (
        "lo",
        "GLOO_SOCKET_IFNAME, as set",
    )
    # NCCL reads names as prefixes ("=": exact); Gloo wants the interfaces themselves.
    assert choose_gloo_interface({"NCCL_SOCKET_IFNAME": "l"}) == ("lo", "NCCL_SOCKET_IFNAME")
    assert choose_gloo_interface({"NCCL_SOCKET_IFNAME": "=lo"}) == ("lo", "NCCL_SOCKET_IFNAME")
    route = ("lo", "the route to MASTER_ADDR 127.0.0.1")
    for nccl in ("^docker,lo", "=l", "no-such-interface"):
        environ = {"NCCL_SOCKET_IFNAME": nccl, "MASTER_ADDR": "127.0.0.1"}
        assert choose_gloo_interface(environ) == route, nccl
    assert choose_gloo_interface({"MASTER_ADDR": "localhost"})[0] == "lo"  # type: ignore[index]
    assert choose_gloo_interface({}) is None
    environ: dict[str, str] = {"MASTER_ADDR": "127.0.0.1"}
    assert set_gloo_interface(environ) == f"Gloo interface: {route[0]} ({route[1]})"
    assert environ["GLOO_SOCKET_IFNAME"] == "lo"
    assert "set GLOO_SOCKET_IFNAME" in set_gloo_interface({})
