"""The trainer: build everything from the config, then run training steps.

Read top to bottom, this file is the story of a run: where it runs, what data it reads, how
the model is built (meta → float8 → activation checkpointing → compile → FSDP → init), how
one step goes (micro-batches, clipping, update, float8 scales), and what happens around steps
(logging, validation, checkpoints, preemption). Anything the user can fix ends the run with one
line on stderr and exit code 2.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from titanlike import float8, parallel
from titanlike.checkpoint import Checkpointer, TrainState
from titanlike.config import ConfigError, JobConfig, load_config, to_toml
from titanlike.data import build_train_loader, open_dataset, resolve_paths, validation_batches
from titanlike.errors import UserError
from titanlike.metrics import MetricsLogger
from titanlike.model import Transformer, flops_per_token, model_args
from titanlike.optim import build_optimizer, build_scheduler, clip_grad_norm
from titanlike.profiling import Profiler

logger = logging.getLogger("titanlike")


# Exit code of a preflight (run_train.sh, before torchrun) that printed the config: stop, no error.
PRINTED_CONFIG = 3


class NonFiniteLoss(UserError):
    pass


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # In fp32 whatever the logits' dtype; compiled, the upcast fuses into the softmax instead of
    # materialising a float copy of the (tokens × vocab) logits.
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def preflight(cfg: JobConfig, world_size: int) -> tuple[int, int, int, int]:
    """Checks that need the world size but no GPU: (dp_replicate, dp_shard, global batch, micro-batches).

    run_train.sh runs this before starting torchrun, so a typo costs a second, not a queue slot.
    """
    t = cfg.training
    dp_replicate, dp_shard = parallel.resolve_dims(world_size, cfg.parallel.dp_shard, cfg.parallel.dp_replicate)
    dp = dp_replicate * dp_shard
    global_batch = t.global_batch_size or t.local_batch_size * dp
    if global_batch % (t.local_batch_size * dp):
        raise ConfigError(
            f"training.global_batch_size = {global_batch} must be a multiple of training.local_batch_size × "
            f"data-parallel degree = {t.local_batch_size} × {dp} = {t.local_batch_size * dp}"
        )
    if cfg.data.path:  # headers only: cheap, and catches wrong files before any GPU is touched
        vocab = model_args(cfg.model.flavor, cfg.model.vocab_size, cfg.model.tie_embeddings).vocab_size
        open_dataset(cfg.data.path, cfg.data.seq_len, vocab, "data.path")
    return dp_replicate, dp_shard, global_batch, global_batch // (t.local_batch_size * dp)


class Trainer:
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        t = cfg.training

        # ---- 1. Where we run: ranks, device, mesh -------------------------------------------
        world, rank, local_rank = parallel.world_from_env()
        dp_replicate, dp_shard, self.global_batch, self.accum_steps = preflight(cfg, world)
        self.dims = parallel.ParallelDims(world, rank, local_rank, dp_replicate, dp_shard)
        self.is_main = rank == 0
        self.device = parallel.pick_device(t.device, local_rank)
        self.fp8 = float8.resolve(cfg.fp8, dp_shard)
        float8.check_device(self.fp8, self.device)  # before the process group: fail fast, alone
        if t.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
            torch.backends.cudnn.benchmark = False
        self.mesh = parallel.init_distributed(self.dims, self.device, cfg.parallel.backend_timeout_s)
        torch.manual_seed(cfg.job.seed)
        os.makedirs(cfg.job.dump_folder, exist_ok=True)
        if self.is_main:
            with open(os.path.join(cfg.job.dump_folder, "config.toml"), "w") as f:
                f.write(to_toml(cfg))

        # ---- 2. Data: every rank reads its own slice of each global batch ----------------------
        self.margs = model_args(cfg.model.flavor, cfg.model.vocab_size, cfg.model.tie_embeddings)
        train_path, val_path = resolve_paths(cfg.data.path, cfg.data.val_path, cfg.job.dump_folder)
        self.train_data = open_dataset(train_path, cfg.data.seq_len, self.margs.vocab_size, "data.path")
        self.val_data = (
            open_dataset(val_path, cfg.data.seq_len, self.margs.vocab_size, "data.val_path")
            if val_path and cfg.validation.enable else None
        )
        self.dp_rank = rank  # the mesh is (replicate, shard) in rank order, so DP rank = rank
        self.loader = build_train_loader(
            self.train_data, t.local_batch_size, self.global_batch, self.dp_rank, self.dims.dp,
            cfg.job.seed, cfg.data.num_workers, pin_memory=self.device.type == "cuda",
        )
        self.batches = None  # the loader's iterator; created lazily so a resumed state applies first

        # ---- 3. Model: meta → float8 → AC → compile → FSDP → materialise → init ------------------
        with torch.device("meta"):
            model = Transformer(self.margs)
        float8.measure(model, self.fp8, t.local_batch_size * cfg.data.seq_len, self.device)
        float8.convert(model, self.fp8)
        parallel.apply_activation_checkpointing(model, cfg.activation_checkpoint.mode,
                                                cfg.activation_checkpoint.selective_ac_option)
        if cfg.compile.enable:
            float8.configure_compile(self.fp8, True)
            parallel.apply_compile(model)
        # bf16 compute on GPU: FSDP casts the gathered parameters; one GPU uses autocast instead.
        gpu_bf16 = self.device.type == "cuda" and t.mixed_precision == "bf16"
        if self.dims.sharded:
            parallel.apply_fsdp(model, self.mesh, torch.bfloat16 if gpu_bf16 else None,
                                cfg.parallel.reshard_after_forward)
        self.autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16) if gpu_bf16 and not self.dims.sharded else contextlib.nullcontext()
        )
        model.to_empty(device=self.device)
        model.init_weights(cfg.job.seed, cfg.data.seq_len)
        self.model = model
        self.loss_fn = torch.compile(cross_entropy) if cfg.compile.enable else cross_entropy
        self.flops_per_token = flops_per_token(self.margs, cfg.data.seq_len)
        float8_share = float8.float8_matmul_share(model, self.flops_per_token)
        if self.is_main:
            float8.log_plan(self.fp8, float8_share)

        # ---- 4. Optimizer and LR schedule ---------------------------------------------------------
        o, s = cfg.optimizer, cfg.lr_scheduler
        self.optimizer = build_optimizer(model, o.lr, o.weight_decay, o.betas, o.eps, self.device.type)
        self.scheduler = build_scheduler(self.optimizer, t.steps, s.warmup_steps, s.decay_ratio, s.decay_type,
                                         s.min_lr_factor)
        self.state = TrainState()

        # ---- 5. Checkpoints: resume from the newest complete one, if any ---------------------------
        self.checkpointer = Checkpointer(cfg.checkpoint, cfg.job.dump_folder, self, is_main=self.is_main)
        self.checkpointer.load_or_initialize()
        # Scales depend on the (possibly just loaded) weights: compute them now, never before loading.
        float8.post_optimizer_step(self.model, self.fp8)

        # ---- 6. Metrics and profiling ------------------------------------------------------------
        self.metrics = MetricsLogger(
            cfg.job.dump_folder, is_writer=self.is_main, tensorboard=cfg.metrics.enable_tensorboard,
            device=self.device, flops_per_token=self.flops_per_token, float8_matmul_share=float8_share,
        )
        self.profiler = Profiler(cfg.profiling, cfg.job.dump_folder, rank, self.device, start_step=self.state.step)
        if self.is_main:
            n_params = sum(p.numel() for p in self.model.parameters())
            logger.info(
                f"model {cfg.model.flavor}: {n_params / 1e6:,.1f}M parameters | {world} rank(s) on {self.device.type} "
                f"(dp_replicate {dp_replicate} × dp_shard {dp_shard}) | global batch {self.global_batch} = "
                f"{t.local_batch_size} × {self.dims.dp} ranks × {self.accum_steps} micro-batches | seq {cfg.data.seq_len}"
            )
        self._window_losses: list[torch.Tensor] = []

    # ---- one training step ----------------------------------------------------------------------

    def next_batch(self) -> tuple[torch.Tensor, float]:
        start = time.perf_counter()
        if self.batches is None:
            self.batches = iter(self.loader)
        batch = next(self.batches).to(self.device, non_blocking=True)
        return batch, time.perf_counter() - start

    def train_step(self) -> torch.Tensor:
        """Forward and backward over the micro-batches of one global batch, then one update."""
        self.optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), device=self.device)
        data_wait = 0.0
        for _ in range(self.accum_steps):
            batch, wait = self.next_batch()
            data_wait += wait
            inputs, targets = batch[:, :-1], batch[:, 1:]
            with self.autocast:
                loss = self.loss_fn(self.model(inputs), targets)
            # Each micro-batch has the same token count, so the mean of means is the batch mean;
            # FSDP averages over ranks in its reduce-scatter.
            (loss / self.accum_steps).backward()
            step_loss += loss.detach() / self.accum_steps
        grad_norm = clip_grad_norm([p for p in self.model.parameters()], self.cfg.training.max_norm)
        self.lr = self.optimizer.param_groups[0]["lr"]  # the LR this update used, for the log
        self.checkpointer.before_update()  # a background save may still be copying the weights
        self.optimizer.step()
        self.scheduler.step()
        float8.post_optimizer_step(self.model, self.fp8)
        self.state.step += 1
        self.state.tokens_seen += self.global_batch * self.cfg.data.seq_len
        self.metrics.add_tokens(self.accum_steps * self.cfg.training.local_batch_size * self.cfg.data.seq_len, data_wait)
        self._window_losses.append(torch.stack([step_loss, grad_norm.float()]))
        return grad_norm

    def global_mean(self, values: torch.Tensor) -> torch.Tensor:
        if self.dims.sharded:
            values = values.clone()
            dist.all_reduce(values)  # gloo has no AVG: sum, then divide
            values /= self.dims.world_size
        return values

    def check_losses(self) -> float:
        """Reduce the (loss, grad norm) pairs since the last check over ranks, stop at the first
        non-finite one, return the last loss. One host sync per check, none per step."""
        rows = self.global_mean(torch.stack(self._window_losses)).tolist()
        first = self.state.step - len(rows) + 1
        self._window_losses = []
        for i, (loss, grad_norm) in enumerate(rows):
            for what, value in (("loss", loss), ("gradient norm", grad_norm)):
                if not math.isfinite(value):
                    raise NonFiniteLoss(
                        f"{what} became {value} at step {first + i}; lower --optimizer.lr, raise "
                        f"--lr_scheduler.warmup_steps or check --training.max_norm (last checkpoint kept)"
                    )
        return rows[-1][0]

    @torch.no_grad()
    def validate(self) -> None:
        micro_batches = self.cfg.validation.steps * self.accum_steps  # `steps` global batches
        total = torch.zeros((), device=self.device)
        for batch in validation_batches(self.val_data, self.cfg.training.local_batch_size, self.dp_rank,
                                        self.dims.dp, micro_batches):
            batch = batch.to(self.device)
            with self.autocast:
                total += self.loss_fn(self.model(batch[:, :-1]), batch[:, 1:]).float()
        loss = self.global_mean(total / micro_batches).item()
        self.metrics.log(self.state.step, {"loss": loss, "ppl": math.exp(min(loss, 50.0))}, prefix="val")

    # ---- the loop -----------------------------------------------------------------------------------

    def train(self) -> None:
        cfg = self.cfg
        steps = cfg.training.steps
        if self.state.step >= steps:
            logger.info(f"nothing to do: the checkpoint is at step {self.state.step} and training.steps = {steps}")
            return
        if self.is_main:
            logger.info(f"training from step {self.state.step + 1} to {steps}")
        first_step = self.state.step + 1
        t0 = time.perf_counter()
        self.checkpointer.install_preemption_handlers()
        while self.state.step < steps:
            grad_norm = self.train_step()
            step = self.state.step
            last = step == steps
            if step == first_step:
                # The first step pays for compilation and warm-up: report it, then start timing.
                loss = self.check_losses()
                self.metrics.log(step, {"loss": loss, "grad_norm": grad_norm.item(), "lr": self.lr,
                                        "first_step_s": time.perf_counter() - t0, **self.metrics.memory()})
                self.metrics.start_window()
            elif step % cfg.metrics.log_freq == 0 or last:
                loss = self.check_losses()
                self.metrics.log(step, {"loss": loss, "grad_norm": grad_norm.item(), "lr": self.lr,
                                        "tokens_seen": self.state.tokens_seen, **self.metrics.throughput(),
                                        "float8_matmul_share": self.metrics.float8_share, **self.metrics.memory()})
            if self.val_data is not None and (step % cfg.validation.freq == 0 or last):
                self.validate()
            preempted = self.checkpointer.preemption_requested()
            if self.checkpointer.due(step, last) or preempted:
                if self._window_losses:
                    self.check_losses()  # never save the weights of a diverged run
                self.checkpointer.save(step, final=last or preempted)
            if preempted:
                self.checkpointer.finish()
                marker = os.environ.get("TITANLIKE_PREEMPTED_MARKER")
                if marker and self.dims.local_rank == 0:  # tells run_train.sh on this node: clean stop
                    open(marker, "w").close()
                if self.is_main:
                    logger.info(f"preempted: stopped after step {step}; checkpoint at {self.checkpointer.step_dir(step)}")
                return
            self.profiler.step(step)
        self.checkpointer.finish()
        if self.is_main:
            logger.info(f"done: {steps} steps in {time.perf_counter() - t0:.1f}s")

    def close(self) -> None:
        self.profiler.close()
        self.metrics.close()


def setup_logging(rank: int) -> None:
    log_rank = int(os.environ.get("LOG_RANK", 0))
    level = logging.INFO if rank == log_rank else logging.WARNING
    prefix = f"[rank{rank}] " if int(os.environ.get("WORLD_SIZE", 1)) > 1 else ""
    logging.basicConfig(level=level, format=f"{prefix}%(asctime)s %(message)s", datefmt="%H:%M:%S", force=True)
    logger.setLevel(level)
    # torchao reports optional CUDA extensions it could not load, and trips a pytree deprecation
    # notice at import: neither is actionable for a user.
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    _, rank, _ = parallel.world_from_env()
    setup_logging(rank)
    trainer = None
    try:
        cfg = load_config(argv)
        if cfg.job.print_config:
            if rank == 0:
                print(to_toml(cfg), end="")
            return PRINTED_CONFIG if os.environ.get("TITANLIKE_PREFLIGHT_WORLD") else 0
        if os.environ.get("TITANLIKE_PREFLIGHT_WORLD"):
            preflight(cfg, int(os.environ["TITANLIKE_PREFLIGHT_WORLD"]))
            return 0
        trainer = Trainer(cfg)
        trainer.train()
        return 0
    except UserError as e:
        if rank == 0 or not e.same_on_all_ranks:
            print(f"error: {e}", file=sys.stderr)
        return 2
    except torch.OutOfMemoryError:
        if trainer is not None:
            trainer.profiler.oom_snapshot(trainer.state.step)
        raise
    except RuntimeError as e:
        failure = parallel.collective_failure(e)  # a peer died or hung, or the network failed
        if failure is None:
            raise
        print(f"error: rank {rank} on {socket.gethostname()}: {failure}", file=sys.stderr)
        return 1
    finally:
        if trainer is not None:
            trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def cli() -> None:
    """The `titanlike-train` console script: same as `python -m titanlike.train`."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
