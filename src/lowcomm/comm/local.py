"""``Comm`` for a single worker: every collective is the identity and completes at once."""

from __future__ import annotations

import torch

from lowcomm.comm.base import (
    CompletedHandle,
    Handle,
    ReduceOp,
    Role,
    Segments,
    check_scatter_shapes,
    check_segments,
)


class LocalComm:
    """A group of one. Lets every strategy run in a plain single-process script."""

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def all_reduce(
        self,
        tensor: torch.Tensor,
        *,
        op: ReduceOp = "mean",
        role: Role,
        segments: Segments | None = None,
    ) -> Handle:
        check_segments(tensor, segments)
        return CompletedHandle()

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, op: ReduceOp = "sum", role: Role
    ) -> Handle:
        check_scatter_shapes(output, input, 1, "reduce_scatter")
        output.copy_(input.view_as(output))
        return CompletedHandle()

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, role: Role) -> Handle:
        check_scatter_shapes(output, input, 1, "all_gather")
        output.copy_(input.view_as(output))
        return CompletedHandle()

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *, role: Role) -> Handle:
        check_scatter_shapes(output, input, 1, "all_to_all")
        output.copy_(input.view_as(output))
        return CompletedHandle()

    def broadcast(self, tensor: torch.Tensor, *, src: int, role: Role) -> Handle:
        if src != 0:
            raise ValueError(f"broadcast: src {src} does not exist in a group of one")
        return CompletedHandle()

    def barrier(self) -> Handle:
        return CompletedHandle()
