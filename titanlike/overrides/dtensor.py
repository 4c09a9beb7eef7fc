"""A DTensor around a local shard that stays where it is (not switched: the host copies of a background
save need it, and DTensor.from_local moves a shard to its mesh's device)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def with_local(like: DTensor, local: torch.Tensor) -> DTensor:
    """A DTensor with `like`'s mesh, placements and global shape around `local` (a host copy of its shard),
    on the host: DTensor's own constructor, with `like`'s spec."""
    return DTensor(local, like._spec, requires_grad=False)
