"""The base of lowcomm's dispatch modes (element counting, deferred and shapes-only builds)."""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


class PlainDispatchMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """A dispatch mode whose ``__torch_dispatch__`` torch leaves as written.

    torch wraps a mode's ``__torch_dispatch__`` so that ``torch.compile`` never compiles it,
    and the wrapper imports torch's compiler stack (``torch._dynamo``, about 2-3 s of a CPU
    core) on the mode's first operation: every worker process and every ``lowcomm`` command
    paid it. lowcomm's modes are plain Python around ATen calls, never inside a compiled
    region's own code, so they go without the wrapper."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)  # type: ignore[no-untyped-call]

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False
