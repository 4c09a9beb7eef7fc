"""Where a run runs, in numbers: world size and ranks from torchrun's environment, the data-parallel
degrees, and how the global batch splits into micro-batches. Plain arithmetic: the preflight checks
these against the config before torchrun starts any worker, and the resolved run (run.py) holds them.

The degrees and the batch plan are the same on every rank; which rank a process is (`Ranks`) is its
own, and stays out of them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

from titanlike.config.fp8 import float8_all_gather
from titanlike.config.loader import ConfigError
from titanlike.config.schema import JobConfig


class Ranks(NamedTuple):
    """This process's place in the run, as torchrun sets it (a tuple: `world, rank, local_rank = ...`)."""

    world_size: int
    rank: int
    local_rank: int


def world_from_env() -> Ranks:
    """(world size, rank, local rank) as torchrun sets them; a plain `python` run is 1, 0, 0."""
    return Ranks(int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0)),
                 int(os.environ.get("LOCAL_RANK", 0)))


def local_world() -> int:
    """The processes of this run on this host, as torchrun sets LOCAL_WORLD_SIZE; 1 for a plain `python` run."""
    text = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return int(text) if text.isdigit() and int(text) >= 1 else 1


def check_cp_divides(world_size: int, cp: int) -> None:
    """Each context group is cp ranks: ConfigError (one line) where cp does not divide the world."""
    if world_size % cp:
        raise ConfigError(f"parallel.cp = {cp} does not divide the {world_size} ranks")


def resolve_dims(world_size: int, dp_shard: int, dp_replicate: int, cp: int = 1) -> tuple[int, int]:
    """Check the data-parallel degrees against the world size; -1 takes what is left. The cp ranks of
    each data-parallel group come out of the world first: dp_replicate × dp_shard = world / cp."""
    check_cp_divides(world_size, cp)
    ranks = world_size // cp
    of_ranks = f"{world_size} ranks" if cp == 1 else f"{ranks} data-parallel ranks ({world_size} ranks / cp {cp})"
    if dp_replicate == -1:
        if dp_shard == -1 or ranks % dp_shard:
            raise ConfigError(
                f"parallel.dp_replicate = -1 needs parallel.dp_shard to be a divisor of the {of_ranks} "
                f"(got {dp_shard})"
            )
        dp_replicate = ranks // dp_shard
    if ranks % dp_replicate:
        raise ConfigError(f"parallel.dp_replicate = {dp_replicate} does not divide the {of_ranks}")
    if dp_shard == -1:
        dp_shard = ranks // dp_replicate
    if dp_shard * dp_replicate != ranks:
        raise ConfigError(
            f"parallel.dp_replicate × parallel.dp_shard = {dp_replicate} × {dp_shard} must equal the "
            f"{of_ranks} (set parallel.dp_shard = -1 to use all of them)"
        )
    return dp_replicate, dp_shard


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    dp_replicate: int
    """Replicas of the sharded model (HSDP; 1 = plain FSDP)."""
    dp_shard: int
    """Data-parallel ranks each replica's weights are sharded over (FSDP shards over dp_shard × cp)."""
    global_batch: int
    """Samples per optimizer step over all ranks."""
    accum_steps: int
    """Micro-batches per rank per optimizer step (gradient accumulation)."""
    cp: int = 1
    """Ranks that split each sample's sequence (context parallelism); they read the same samples."""

    @property
    def dp(self) -> int:
        """Data-parallel degree: groups of ranks that read different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_shard(self) -> int:
        """Ranks each replica's weights are sharded over: dp_shard × cp."""
        return self.dp_shard * self.cp

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    # ---- the rank layout: (dp_replicate, dp_shard, cp), cp innermost --------------------------------------
    # The ranks of a context group are neighbours (one node, the fastest links, for the all-gathers of every
    # attention layer); FSDP shards over dp_shard × cp. A degree added inside cp (tensor parallelism) would
    # go innermost, and these three say where it lies.

    def dp_rank(self, rank: int) -> int:
        """The data-parallel rank of global rank `rank`: the cp ranks of a data-parallel group read the same
        samples (each keeps its part of every sequence)."""
        return rank // self.cp

    @property
    def fsdp_mesh(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """FSDP's mesh, (shape, dimension names): (dp_replicate, dp_shard × cp), or (dp_shard × cp,) without
        replicas (the two degrees flattened into one dimension when built, not by DeviceMesh's private
        `_flatten`)."""
        shard = "dp_shard" if self.cp == 1 else "dp_shard_cp"
        if self.dp_replicate > 1:
            return (self.dp_replicate, self.fsdp_shard), ("dp_replicate", shard)
        return (self.fsdp_shard,), (shard,)

    @property
    def context_mesh(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The mesh whose "cp" dimension is a rank's context group, (shape, dimension names)."""
        return (self.world_size // self.cp, self.cp), ("dp", "cp")


def parallel_dims(cfg: JobConfig, world_size: int) -> ParallelDims:
    """The degrees and the batch plan a config means at this world size; ConfigError (one line) if none."""
    t = cfg.training
    cp = cfg.parallel.cp
    dp_replicate, dp_shard = resolve_dims(world_size, cfg.parallel.dp_shard, cfg.parallel.dp_replicate, cp)
    check_offload(cfg, dp_replicate, dp_shard * cp)
    dp = dp_replicate * dp_shard
    global_batch = t.global_batch_size or t.local_batch_size * dp
    if global_batch % (t.local_batch_size * dp):
        raise ConfigError(
            f"training.global_batch_size = {global_batch} must be a multiple of training.local_batch_size × "
            f"data-parallel degree = {t.local_batch_size} × {dp} = {t.local_batch_size * dp}"
        )
    return ParallelDims(world_size, dp_replicate, dp_shard, global_batch, global_batch // (t.local_batch_size * dp),
                        cp)


def check_offload(cfg: JobConfig, dp_replicate: int, dp_shard: int) -> None:
    """parallel.cpu_offload against the degrees this world size resolves to (config-only rules: the schema)."""
    if not cfg.parallel.cpu_offload:
        return
    if dp_replicate > 1:
        raise ConfigError(
            f"parallel.cpu_offload works with plain FSDP, not HSDP (parallel.dp_replicate resolves to {dp_replicate}): "
            f"set --parallel.dp_replicate 1")
    fp8 = cfg.fp8
    if fp8.enable_fsdp_float8_all_gather is None and float8_all_gather(fp8, dp_shard):
        raise ConfigError(
            f"parallel.cpu_offload cannot all-gather weights in float8, which {fp8.recipe} turns on with more than "
            f"one shard: set --fp8.enable_fsdp_float8_all_gather false")
