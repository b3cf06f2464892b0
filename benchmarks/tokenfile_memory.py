"""Memory of one worker's data against the size of a token file (issue 28, item 6).

For each size (default 100 MB, 1 GB, 2 GB), a file of random uint16 token ids (uniform over a
65,536-token vocabulary) is written, and two fresh worker processes are measured side by side:

- **before**: the data path lowcomm had until this change, reproduced here in a few lines (the
  cache was an ``.npz`` that every rank loaded whole; ``WorkerShard`` then concatenated the
  training streams into one array and built per-window start and source arrays, and the
  validation set concatenated the held-out streams);
- **after**: ``prepare_corpus`` on ``--data FILE.bin --data-dtype uint16`` (the file mapped with
  ``numpy.memmap``), ``WorkerShard`` and ``validation_batches`` as a worker builds them.

Each process imports lowcomm and torch, notes its resident memory, builds worker 0 of 4's
shard (1024-token windows, micro-batches of 8) and 10 validation batches, draws 50
micro-batches and, with all of that still alive, reports what its resident memory grew by:
its private (anonymous) part, ``RssAnon``, which is what each rank pays for itself, and its
file-backed part, ``RssFile``: pages of the mapped token file, which sit in the page cache,
are shared by every rank of the machine, and are dropped by the kernel under memory pressure
(the kernel maps a cached file in large folios, so a few windows drawn show up as megabytes
here; over an epoch this part tends to the file's size, once per machine). Also its peak
resident memory, ``VmHWM`` (both parts, imports included). Then ``--ranks`` (4) "after"
workers run at once on the same file and report, all alive and done drawing, their
private memory and, from ``/proc/self/smaps``, the resident and proportional size of their
mapping of the token file (``Pss``: a page shared by N processes counts 1/N in each). The files are deleted
at the end (``--keep`` keeps them).

    python benchmarks/tokenfile_memory.py                  # 100 MB, 1 GB, 2 GB
    python benchmarks/tokenfile_memory.py --sizes-mb 100   # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

VOCAB = 1 << 16
_ALIVE: list[Any] = []
SEQ_LEN, MICRO_BATCH, WORKERS, DRAWS, VAL_BATCHES = 1024, 8, 4, 50, 10


def _mapping_of(path: Path) -> dict[str, int]:
    """Resident (``Rss``) and proportional (``Pss``: a page shared by N processes counts 1/N)
    bytes of this process's mappings of ``path`` (/proc/self/smaps)."""
    totals = {"Rss": 0, "Pss": 0}
    inside = False
    target = str(path.resolve())
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):  # a mapping's header line
            inside = line.rstrip().endswith(target)
        elif inside and first in ("Rss:", "Pss:"):
            totals[first[:-1]] += int(line.split()[1]) * 1024
    return totals


def _rendezvous(directory: Path, stage: str, ranks: int) -> None:
    """Wait until ``ranks`` processes have reached ``stage`` (files in ``directory``)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{stage}-{os.getpid()}").touch()
    while len(list(directory.glob(f"{stage}-*"))) < ranks:
        time.sleep(0.05)


def _status() -> dict[str, int]:
    """This process's memory lines of /proc/self/status, in bytes."""
    fields: dict[str, int] = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


def _old_worker(path: Path, val_fraction: float) -> dict[str, int]:
    """The former path: the corpus loaded whole, then the former WorkerShard's and
    validation_batches' arrays (``_flatten``: one concatenated copy; ``_window_starts``: an
    int64 start and an int64 source per window)."""
    import torch

    tokens = np.fromfile(path, dtype=np.uint16)  # what np.load of the .npz cache did
    held_out = int(np.ceil(len(tokens) * val_fraction))
    train, validation = [tokens[: len(tokens) - held_out]], [tokens[len(tokens) - held_out :]]
    flat = np.concatenate(train)
    window = SEQ_LEN + 1
    count = len(flat) // window
    starts = window * np.arange(count, dtype=np.int64)
    sources = np.zeros(count, dtype=np.int64)
    val_flat = np.concatenate(validation)
    order = np.random.default_rng([0, 0]).permutation(count)[: count // WORKERS * WORKERS]
    mine = order[0::WORKERS]
    for draw in range(DRAWS):
        chosen = starts[mine[draw * MICRO_BATCH : (draw + 1) * MICRO_BATCH]]
        positions = chosen[:, None] + np.arange(window)[None, :]
        torch.from_numpy(flat[positions].astype(np.int64))
    for batch in range(VAL_BATCHES):
        positions = window * (batch * MICRO_BATCH + np.arange(MICRO_BATCH))[:, None]
        torch.from_numpy(val_flat[positions + np.arange(window)[None, :]].astype(np.int64))
    status = _status()  # while the worker's arrays are alive, as they are in training
    del tokens, flat, sources, val_flat
    return status


def _new_worker(path: Path, tokenizer: Path, cache: Path) -> dict[str, int]:
    from lowcomm.data import DataConfig, WorkerShard, prepare_corpus, validation_batches

    config = DataConfig(
        data=str(path), data_dtype="uint16", tokenizer=str(tokenizer), cache_dir=str(cache)
    )
    corpus = prepare_corpus(config)
    assert corpus.from_cache, "the parent checks the file first, as the launcher does"
    shard = WorkerShard(corpus, 0, WORKERS, SEQ_LEN, MICRO_BATCH, seed=0)
    validation_batches(corpus, SEQ_LEN, MICRO_BATCH, VAL_BATCHES)
    for _ in range(DRAWS):
        shard.next_batch()
    _ALIVE.append((corpus, shard))  # mapped until the process ends, as in training
    return _status()


def worker(mode: str, path: Path, tokenizer: Path, cache: Path) -> dict[str, Any]:
    """One measured worker process (run as ``--worker MODE ...``)."""
    import torch  # noqa: F401  (the imports' memory is the baseline)

    import lowcomm.data  # noqa: F401

    baseline = _status()
    started = time.perf_counter()
    old = mode == "before"
    status = _old_worker(path, 0.05) if old else _new_worker(path, tokenizer, cache)
    seconds = time.perf_counter() - started
    if mode == "after-ranks":  # every rank alive and done drawing, then all measure
        sync = Path(os.environ["TOKENFILE_BENCH_SYNC"])
        ranks = int(os.environ["TOKENFILE_BENCH_RANKS"])
        _rendezvous(sync, "drawn", ranks)
        mapped = _mapping_of(path)
        _rendezvous(sync, "measured", ranks)
        anon = status["RssAnon"] - baseline["RssAnon"]
        return {"anon": anon, "rss": mapped["Rss"], "pss": mapped["Pss"]}
    return {
        "peak": status["VmHWM"], "anon": status["RssAnon"] - baseline["RssAnon"],
        "file": status["RssFile"] - baseline["RssFile"], "seconds": seconds,
    }  # fmt: skip


def _tokenizer(directory: Path) -> Path:
    """A word-level tokenizer of 65,536 ids (the last one ``<|endoftext|>``), so that every
    uint16 id is a token."""
    import tokenizers

    vocab = {f"t{index}": index for index in range(VOCAB - 1)}
    vocab["<|endoftext|>"] = VOCAB - 1
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tokenizer.add_special_tokens(["<|endoftext|>"])
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def _write_tokens(path: Path, size_mb: int) -> None:
    rng = np.random.default_rng(0)
    remaining = size_mb * (1 << 20) // 2
    with open(path, "wb") as handle:
        while remaining:
            count = min(remaining, 1 << 26)
            handle.write(rng.integers(0, VOCAB, count, dtype=np.uint16).tobytes())
            remaining -= count


def _measure(mode: str, path: Path, tokenizer: Path, cache: Path) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, __file__, "--worker", mode, str(path), str(tokenizer), str(cache)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    measured: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return measured


def _measure_ranks(path: Path, tokenizer: Path, cache: Path, ranks: int) -> dict[str, float]:
    """``ranks`` "after" workers at once on the same file: their mean private memory, and the
    resident and proportional size of their mapping of the file."""
    sync = cache / f"sync-{path.stem}"
    environment = {
        **os.environ,
        "TOKENFILE_BENCH_SYNC": str(sync),
        "TOKENFILE_BENCH_RANKS": str(ranks),
    }
    command = [sys.executable, __file__, "--worker", "after-ranks", str(path), str(tokenizer)]
    processes = [
        subprocess.Popen([*command, str(cache)], stdout=subprocess.PIPE, text=True, env=environment)
        for _ in range(ranks)
    ]
    results = [
        json.loads(process.communicate()[0].strip().splitlines()[-1]) for process in processes
    ]
    return {name: sum(result[name] for result in results) / ranks for name in results[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 1024, 2048])
    parser.add_argument("--dir", type=Path, default=None, help="where the files go (a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the token files")
    parser.add_argument("--ranks", type=int, default=4, help="workers at once for the PSS table")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.worker:
        mode, path, tokenizer, cache = arguments.worker
        print(json.dumps(worker(mode, Path(path), Path(tokenizer), Path(cache))))
        return
    directory = Path(tempfile.mkdtemp(prefix="tokenfile-bench-", dir=arguments.dir))
    tokenizer, cache = _tokenizer(directory), directory / "cache"
    mb = 1 << 20
    print(
        "| token file | worker | private memory (RssAnon) | mapped file pages (RssFile) "
        "| peak RSS (VmHWM) | set-up + draws |"
    )
    print("|---|---|---|---|---|---|")
    from lowcomm.data import DataConfig, prepare_corpus

    shared: list[str] = []
    for size_mb in arguments.sizes_mb:
        path = directory / f"tokens-{size_mb}mb.bin"
        _write_tokens(path, size_mb)
        config = DataConfig(
            str(path), data_dtype="uint16", tokenizer=str(tokenizer), cache_dir=str(cache)
        )
        prepare_corpus(config)  # the launcher's one check of the ids; workers find it cached
        for mode in ("before", "after"):
            r = _measure(mode, path, tokenizer, cache)
            print(
                f"| {size_mb:,} MB | {mode} | {r['anon'] / mb:,.0f} MB | {r['file'] / mb:,.0f} MB "
                f"| {r['peak'] / mb:,.0f} MB | {r['seconds']:.2f} s |",
                flush=True,
            )
        pss = _measure_ranks(path, tokenizer, cache, arguments.ranks)
        shared.append(
            f"| {size_mb:,} MB | {arguments.ranks} | {pss['anon'] / mb:,.1f} MB "
            f"| {pss['rss'] / mb:,.1f} MB | {pss['pss'] / mb:,.1f} MB |"
        )
        if not arguments.keep:
            path.unlink()
    print(f"\n{arguments.ranks} 'after' workers at once on the same file, per worker (mean):\n")
    print(
        "| token file | workers | private memory (RssAnon) | token file resident (Rss) "
        "| token file proportional (Pss) |"
    )
    print("|---|---|---|---|---|")
    print("\n".join(shared))
    if not arguments.keep:
        import shutil

        shutil.rmtree(directory)


if __name__ == "__main__":
    main()
