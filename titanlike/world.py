"""Where a run runs, in numbers: world size and ranks from torchrun's environment, the data-parallel
degrees, and how the global batch splits into micro-batches. Plain Python: the preflight checks
these against the config before torchrun starts any worker.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from titanlike.config import ConfigError


def world_from_env() -> tuple[int, int, int]:
    """(world size, rank, local rank) as torchrun sets them; a plain `python` run is 1, 0, 0."""
    return int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))


def resolve_dims(world_size: int, dp_shard: int, dp_replicate: int) -> tuple[int, int]:
    """Check the data-parallel degrees against the world size; -1 takes what is left."""
    if dp_replicate == -1:
        if dp_shard == -1 or world_size % dp_shard:
            raise ConfigError(
                f"parallel.dp_replicate = -1 needs parallel.dp_shard to be a divisor of the {world_size} ranks "
                f"(got {dp_shard})"
            )
        dp_replicate = world_size // dp_shard
    if world_size % dp_replicate:
        raise ConfigError(f"parallel.dp_replicate = {dp_replicate} does not divide the {world_size} ranks")
    if dp_shard == -1:
        dp_shard = world_size // dp_replicate
    if dp_shard * dp_replicate != world_size:
        raise ConfigError(
            f"parallel.dp_replicate × parallel.dp_shard = {dp_replicate} × {dp_shard} must equal the "
            f"{world_size} ranks (set parallel.dp_shard = -1 to use all of them)"
        )
    return dp_replicate, dp_shard


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    rank: int
    local_rank: int
    dp_replicate: int
    dp_shard: int
    global_batch: int
    """Samples per optimizer step over all ranks."""
    accum_steps: int
    """Micro-batches per rank per optimizer step (gradient accumulation)."""

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def sharded(self) -> bool:
        return self.world_size > 1


def parallel_dims(cfg, world_size: int, rank: int = 0, local_rank: int = 0) -> ParallelDims:
    """The degrees and the batch plan a config means at this world size; ConfigError (one line) if none."""
    t = cfg.training
    dp_replicate, dp_shard = resolve_dims(world_size, cfg.parallel.dp_shard, cfg.parallel.dp_replicate)
    dp = dp_replicate * dp_shard
    global_batch = t.global_batch_size or t.local_batch_size * dp
    if global_batch % (t.local_batch_size * dp):
        raise ConfigError(
            f"training.global_batch_size = {global_batch} must be a multiple of training.local_batch_size × "
            f"data-parallel degree = {t.local_batch_size} × {dp} = {t.local_batch_size * dp}"
        )
    return ParallelDims(world_size, rank, local_rank, dp_replicate, dp_shard, global_batch,
                        global_batch // (t.local_batch_size * dp))
