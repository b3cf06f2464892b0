"""Give freed tensors' memory back to the system when many workers share one process.

PyTorch allocates a CPU tensor's memory with the C library's ``malloc``. glibc serves a large
block with its own ``mmap`` and returns it to the system when it is freed, but after the
first such block is freed it raises that threshold to the block's size (up to 32 MiB), so
that later blocks of that size come from its heaps instead. K workers in one process then
interleave, in glibc's few heaps, their long-lived tensors (an optimizer's moments are made at
its first step) with every micro-batch's activations; a heap returns only its free top to the
system, so the holes the activations leave stay the process's: with 64 workers of the default
model (3.7 M parameters) in one process, ddp's peak resident memory is more than twice the
workers' tensors (about 3.5 GiB).

:func:`return_large_blocks` fixes glibc's threshold at :data:`MMAP_THRESHOLD`: every block at
least that large is mapped on its own and returned when freed, so what the process holds
follows what its tensors hold. The price is the kernel's work for each such block (mapping
fresh zeroed pages): with 32 workers of the default model, about 1.25x the wall time
(docs/results/inprocess.md, "The fixed mmap threshold"). Blocks under 1 MiB are served by
glibc's heaps as usual. Only the in-process launchers call it (one worker per process keeps
one worker's tensors in its heap), and a ``MALLOC_MMAP_THRESHOLD_`` the user set wins.
"""

from __future__ import annotations

import ctypes
import os

#: Blocks at least this large are mapped on their own (glibc's ``M_MMAP_THRESHOLD``).
MMAP_THRESHOLD = 1 << 20

#: glibc's ``mallopt`` parameter number of the threshold (malloc.h).
_M_MMAP_THRESHOLD = -3


def return_large_blocks() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD` for this process; return whether
    it was set (False: not glibc, or the user's ``MALLOC_MMAP_THRESHOLD_`` is in force)."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is not None:
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: mallopt's numbers are its own)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
