"""torch's multi-tensor ops, one launch for a list of tensors (not switched: torch's optimizers use the
same private names, and the public alternative, a loop, is a launch per tensor: 784 of them after each
step of delayed scaling on `1b`)."""

from __future__ import annotations

import torch


def copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    torch._foreach_copy_(dst, src)


def zero_(tensors: list[torch.Tensor]) -> None:
    torch._foreach_zero_(tensors)


def add_(tensors: list[torch.Tensor], value: float) -> None:
    torch._foreach_add_(tensors, value)
