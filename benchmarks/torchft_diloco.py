"""torchft's own DiLoCo (``torchft.local_sgd.DiLoCo``) on the model of ``lowcomm bench
membership``, with the same kill and restart, for the figures beside lowcomm's.

Three replica processes train lowcomm's GPT (2 blocks, width 128, 64-token blocks,
micro-batches of 4 random-token rows) with AdamW inner steps and outer Nesterov SGD, each a
torchft replica group with its own Manager (synchronous quorum, as DiLoCo requires) and
torchft's default HTTP checkpoint transport for healing, against a lighthouse on 127.0.0.1.
Every listener is kept on the loopback as lowcomm does (the manager server through lowcomm's
wrapper, the store on a bound socket; the HTTP server binds every interface but is reached
through the host name, which resolves to 127.0.0.1 here).

Reported: tokens per second with no fault; after replica 2 is SIGKILLed at a quarter of the
run, the seconds to the survivors' next committed sync; after it is started again at once,
the bytes and seconds of its healing transfer and the seconds from its start to its first
committed sync.

    PYTHONPATH=src python benchmarks/torchft_diloco.py [--steps 120] [--sync-every 10]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any


def _replica(rid: int, lighthouse: str, steps: int, sync_every: int, log: str) -> None:
    import torch
    from torch.utils._pytree import tree_leaves
    from torchft.checkpointing import HTTPTransport
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    from lowcomm.membership.options import require_torchft
    from lowcomm.membership.torchft_comm import _manager_server_on, bound_store
    from lowcomm.models.gpt import GPT, GPTConfig

    require_torchft()
    torch.set_num_threads(1)
    began = time.time()
    out = open(log, "a")  # noqa: SIM115 (held for the process's life; os._exit ends it)

    def note(**event: Any) -> None:
        out.write(json.dumps({"time": time.time(), **event}) + "\n")
        out.flush()

    class TimedHTTP(HTTPTransport):  # type: ignore[misc]
        def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: Any) -> Any:
            start = time.time()
            state = super().recv_checkpoint(src_rank, metadata, step, timeout)
            size = sum(
                t.numel() * t.element_size() for t in tree_leaves(state) if torch.is_tensor(t)
            )
            note(event="healed", seconds=time.time() - start, bytes=size)
            return state

    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=64, vocab_size=2048)
    model = GPT(config)
    store, sock = bound_store("127.0.0.1")
    timeout = timedelta(seconds=60)
    pg = ProcessGroupGloo(timeout=timeout)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    with _manager_server_on("127.0.0.1"):
        manager = Manager(
            pg=pg, load_state_dict=None, state_dict=None, min_replica_size=1,
            use_async_quorum=False, timeout=timeout, quorum_timeout=timedelta(seconds=120),
            rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port,
            lighthouse_addr=f"http://{lighthouse}", replica_id=f"torchft_{rid}", port=0,
            hostname="127.0.0.1", checkpoint_transport=TimedHTTP(timeout, num_chunks=0),
        )  # fmt: skip
    manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
    manager.register_state_dict_fn("inner", inner.load_state_dict, inner.state_dict)
    generator = torch.Generator().manual_seed(rid)
    note(event="start", began=began)
    tokens, last = 0, manager.current_step()
    wall = time.perf_counter()
    with DiLoCo(manager, [model], inner, outer, sync_every=sync_every):
        while manager.current_step() < steps // sync_every:
            batch = torch.randint(
                0, config.vocab_size, (4, config.block_size + 1), generator=generator
            )
            _, loss = model(batch[:, :-1], batch[:, 1:])
            loss.backward()
            inner.step()
            inner.zero_grad()
            tokens += 4 * config.block_size
            if manager.current_step() != last:
                last = manager.current_step()
                note(event="commit", step=last, participants=manager.num_participants())
    note(event="end", tokens=tokens, wall_s=time.perf_counter() - wall)
    manager.shutdown(wait=False)
    sock.close()
    os._exit(0)


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--detect-s", type=float, default=2.0)
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--out", default=None, help="keep the replicas' event logs here")
    args = parser.parse_args()
    from lowcomm.membership.local import loopback_interface
    from lowcomm.membership.options import require_torchft

    require_torchft()
    from torchft.coordination import LighthouseServer

    os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()
    context = multiprocessing.get_context("spawn")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as temporary:
        scratch = args.out or temporary
        Path(scratch).mkdir(parents=True, exist_ok=True)
        for scenario in ("no_fault", "kill"):
            lighthouse = LighthouseServer(
                bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=120_000,
                heartbeat_timeout_ms=int(args.detect_s * 1000),
            )  # fmt: skip
            address = f"127.0.0.1:{lighthouse.address().rpartition(':')[2]}"
            logs = [Path(scratch) / f"{scenario}-{rid}.jsonl" for rid in range(3)]
            rejoin = Path(scratch) / f"{scenario}-2.1.jsonl"

            def start(rid: int, log: Path, address: str = address) -> Any:
                process = context.Process(
                    target=_replica, args=(rid, address, args.steps, args.sync_every, str(log))
                )
                process.start()
                return process

            processes = [start(rid, logs[rid]) for rid in range(3)]
            killed = restarted = None
            if scenario == "kill":
                quarter = args.steps // args.sync_every // 4
                while sum(e["event"] == "commit" for e in _events(logs[2])) < max(1, quarter):
                    time.sleep(0.05)
                os.kill(processes[2].pid, signal.SIGKILL)
                killed = time.time()
                processes[2].join()
                restarted = time.time()
                processes.append(start(2, rejoin))
            for process in processes:
                process.join(600)
            lighthouse.shutdown()
            ends = [e for log in logs[:2] for e in _events(log) if e["event"] == "end"]
            if scenario == "no_fault":
                ends = [e for log in logs for e in _events(log) if e["event"] == "end"]
                results["tokens_per_s"] = sum(e["tokens"] for e in ends) / max(
                    e["wall_s"] for e in ends
                )
                continue
            assert killed is not None and restarted is not None
            stalls = []
            for log in logs[:2]:
                after = [
                    e["time"] for e in _events(log) if e["event"] == "commit" and e["time"] > killed
                ]
                stalls.append(after[0] - killed if after else None)
            joiner = _events(rejoin)
            healed = next((e for e in joiner if e["event"] == "healed"), None)
            first = next((e["time"] for e in joiner if e["event"] == "commit"), None)
            results["kill_to_next_commit_s"] = stalls
            results["heal_bytes"] = None if healed is None else healed["bytes"]
            results["heal_s"] = None if healed is None else healed["seconds"]
            results["start_to_first_commit_s"] = None if first is None else first - restarted
    print(json.dumps(results, indent=1))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
