"""The trainer: build everything from the config, then run training steps.

Read top to bottom, this file is the story of a run: where it runs, what data it reads, how the
model is built (meta → float8 → activation checkpointing → compile → FSDP → init), what resumes it,
how one step goes (micro-batches, clipping, update), and what happens around steps (logging,
validation, checkpoints, a stop request). Each component owns its lifecycle and is called at a few
points: the checkpoint manager (checkpoint/) decides when to save and waits for a background copy
before each update through a hook on the optimizer; the float8 converter (float8/) keeps its scales
after each update through a hook of its own. Anything the user can fix ends the run with one line
on stderr and exit code 2.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from titanlike import parallel
from titanlike.checkpoint.manager import CheckpointManager, RunRecord
from titanlike.checkpoint.states import ModelState, OptimizerState, SchedulerState, TrainState
from titanlike.config import JobConfig, help_text, load_config, resumable_settings, to_toml
from titanlike.config.dims import world_from_env
from titanlike.config.run import resolve_run
from titanlike.data.build import build_run_data
from titanlike.data.loader import validation_batches
from titanlike.data.tokenizer import record_tokenizer
from titanlike.errors import UserError
from titanlike.float8 import Float8Converter
from titanlike.model.decoder import Transformer
from titanlike.model.loss import build_loss, cross_entropy  # noqa: F401  (cross_entropy: tests use it from here)
from titanlike.model.shape import count_params, describe, flops_per_token
from titanlike.optim import build_optimizer, build_scheduler, clip_and_step
from titanlike.preflight import resolved
from titanlike.run import faults, stopping
from titanlike.run.folder import RunFolder
from titanlike.run.metrics import MetricsLogger
from titanlike.run.nonfinite import MAX_IN_A_ROW, NonFinitePolicy, Verdict
from titanlike.run.profiling import Profiler
from titanlike.run.progress import Progress, wants_terminal_line

logger = logging.getLogger("titanlike")


class Trainer:
    def __init__(self, cfg: JobConfig):
        try:
            self._build(cfg)
        except BaseException:
            self.close(publish=False)  # a build stopped half-way unlocks the folders it took
            raise

    def _build(self, cfg: JobConfig) -> None:
        """The parts of a run, in the order each needs the ones before it."""
        self.cfg = cfg
        t = cfg.training

        # ---- 1. Where we run: ranks, device, mesh -------------------------------------------------
        world, rank, local_rank = world_from_env()
        # The shape, degrees, batch plan, sources and phases: resolved once, as the preflight checked them.
        self.run = resolve_run(cfg, world)
        self.dims, self.local_rank = self.run.dims, local_rank
        self.global_batch, self.accum_steps = self.dims.global_batch, self.dims.accum_steps
        self.is_main = rank == 0
        self.device = parallel.pick_device(t.device, local_rank)
        if t.gpu_memory_limit_gib and self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, t.gpu_memory_limit_gib * 2**30 / total), self.device)
        if t.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
            torch.backends.cudnn.benchmark = False
        self.mesh = parallel.init_distributed(self.dims, self.device, cfg.parallel.backend_timeout_s)
        torch.manual_seed(cfg.job.seed)
        # The dump folder is this run's alone (a lock; checked writable before any work).
        self.run_folder = RunFolder(cfg.job.dump_folder, self.is_main)
        if self.is_main:
            logger.info(f"run folder {os.path.abspath(cfg.job.dump_folder)}: the config, metrics and "
                        f"{'checkpoints' if cfg.checkpoint.enable else 'logs'} of this run go there")

        # ---- 2. Data: every rank reads its own slice of each global batch -----------------------------
        # The shape: the preset (or an hf config.json), the [model] overrides, the data's tokenizer.
        shape = self.run.model
        self.margs = shape.args
        if self.is_main:
            record_tokenizer(shape.dataset, cfg.job.dump_folder, builtin_corpus=self.run.builtin_corpus)  # for export
            for note in shape.notes:
                logger.info(note)
        tokenizer = (shape.dataset.vocab_size, shape.dataset.path) if shape.dataset else None
        self.dp_rank = rank  # the mesh is (replicate, shard) in rank order, so DP rank = rank
        # One source (data.path) or a mixture (data.mix): each source's windows, the plan of which
        # source and window every global position reads, and the loader over it (data/build.py).
        self.data = build_run_data(cfg.data, self.run.schedule, self.margs.vocab_size, tokenizer, t.local_batch_size,
                                   self.global_batch, self.dp_rank, self.dims.dp, cfg.job.seed,
                                   pin_memory=self.device.type == "cuda", validation=cfg.validation.enable)
        self.loader = self.data.loader

        # ---- 3. Model: meta → float8 → AC → compile → FSDP → materialise → init ----------------------
        with torch.device("meta"):
            model = Transformer(self.margs, document_end=shape.document_end)  # block_causal splits documents there
        self.flops_per_token = flops_per_token(self.margs, cfg.data.seq_len)
        self.float8 = Float8Converter.from_config(cfg.fp8, self.dims.dp_shard)
        float8_report = self.float8.convert(model, device=self.device, batch=t.local_batch_size,
                                            seq_len=cfg.data.seq_len, flops_per_token=self.flops_per_token,
                                            block_sample=model.sample_block)
        ac = cfg.activation_checkpoint
        parallel.apply_activation_checkpointing(model, ac.mode, ac.selective_ac_option, ac.memory_budget)
        if cfg.compile.enable:
            parallel.apply_compile(model, self.float8.compile_options())
        # bf16 compute on GPU: FSDP casts the gathered parameters; one GPU uses autocast instead.
        gpu_bf16 = self.device.type == "cuda" and t.mixed_precision == "bf16"
        if self.dims.sharded:
            gathered = 2 * count_params(self.margs)[0]  # bytes of every weight gathered in bf16
            reshard = parallel.resolve_reshard(cfg.parallel.reshard_after_forward, gathered,
                                               parallel.device_memory_bytes(self.device, t.gpu_memory_limit_gib))
            parallel.apply_fsdp(model, self.mesh, torch.bfloat16 if gpu_bf16 else None, reshard)
            if self.is_main and reshard != cfg.parallel.reshard_after_forward:
                logger.info(f"FSDP keeps the gathered weights from forward to backward "
                            f"({gathered / 1e9:.1f} GB in bf16, small next to the GPU's memory); "
                            f"--parallel.reshard_after_forward always frees them")
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if gpu_bf16 and not self.dims.sharded
                         else contextlib.nullcontext())
        model.to_empty(device=self.device)
        model.init_weights(cfg.job.seed, cfg.data.seq_len)
        self.model = model
        # loss_fn(model, inputs, targets): over whole logits, or chunk by chunk (training.loss_chunk_tokens);
        # on one process, compiled, the final norm + output layer + loss are one graph (model/loss.py).
        self.loss_fn = build_loss(t.loss_chunk_tokens, cfg.compile.enable, compile_head=not self.dims.sharded)
        # Training's loss: the same, unless a test asks for NaNs on some batches (run/faults.py).
        self.train_loss_fn = faults.with_nan_batches(self.loss_fn, self.batch_number, self.dp_rank)

        # ---- 4. Optimizer and LR schedule ------------------------------------------------------------
        o, s = cfg.optimizer, cfg.lr_scheduler
        self.optimizer = build_optimizer(model, o.lr, o.weight_decay, o.betas, o.eps, self.device.type,
                                         o.state_dtype)
        self.scheduler = build_scheduler(self.optimizer, t.steps, s.warmup_steps, s.decay_ratio, s.decay_type,
                                         s.min_lr_factor)
        self.state = TrainState()

        # ---- 5. Checkpoints: resume from the newest intact one, if any -------------------------------
        # The states load in this order: weights first, then what follows from them (float8's scales).
        states = {"model": ModelState(model), "optimizer": OptimizerState(model, self.optimizer),
                  "lr_scheduler": SchedulerState(self.scheduler), "dataloader": self.loader,
                  "train_state": self.state, "float8": self.float8}
        run = RunRecord(self.margs, self.global_batch, self.dims.dp, cfg.job.seed, o.state_dtype,
                        resumable_settings(cfg, self.run.schedule))
        self.checkpoint = CheckpointManager(
            cfg.checkpoint, cfg.job.dump_folder, states=states, run=run, is_main=self.is_main,
            cuda=self.device.type == "cuda", backend_timeout_s=cfg.parallel.backend_timeout_s,
            optimizer=self.optimizer, before_save=self.losses_are_finite)
        resumed = self.checkpoint.load_or_start(cfg.checkpoint.initial_load_path, cfg.checkpoint.trust_pickled_dcp)

        # ---- 6. Records, metrics and profiling: one run's history per folder --------------------------
        purge_step = self.run_folder.start_records(resumed)
        self.run_folder.write("config.toml", to_toml(self.run.resolved_config()))
        self.metrics = MetricsLogger(
            cfg.job.dump_folder, is_writer=self.is_main, tensorboard=cfg.metrics.enable_tensorboard,
            device=self.device, flops_per_token=self.flops_per_token, float8_matmul_share=float8_report.matmul_share,
            purge_step=purge_step)
        # Float8 follows the weights (initialised or loaded) and updates its scales after each update.
        self.float8.attach(self.optimizer, steps_done=lambda: self.state.step, metrics=self.metrics,
                           log_freq=cfg.metrics.log_freq)
        self.profiler = Profiler(cfg.profiling, cfg.job.dump_folder, rank, self.device, start_step=self.state.step)
        if self.is_main:
            n_params = sum(p.numel() for p in self.model.parameters())
            logger.info(
                f"model {shape.name}: {n_params / 1e6:,.1f}M parameters ({describe(self.margs)}) | "
                f"{world} rank(s) on {self.device.type} "
                f"(dp_replicate {self.dims.dp_replicate} × dp_shard {self.dims.dp_shard}) | global batch "
                f"{self.global_batch} = {t.local_batch_size} × {self.dims.dp} ranks × {self.accum_steps} micro-batches "
                f"| seq {cfg.data.seq_len}")
        self._window_losses: list[torch.Tensor] = []
        self.nonfinite = NonFinitePolicy(t.nonfinite, self.checkpoint.complete_steps, self.checkpoint.step_dir,
                                         is_main=self.is_main)
        self.progress: Progress | None = None  # made when the loop starts (train())

    # ---- one training step ----------------------------------------------------------------------

    def next_batch(self) -> tuple[torch.Tensor, float]:
        start = time.perf_counter()
        batch = next(self.loader).to(self.device, non_blocking=True)
        return batch, time.perf_counter() - start

    def batch_number(self) -> int:
        """The global batch the current step reads, numbered from 1 in data order (a rollback skips some)."""
        return self.state.step + self.state.data_offset + 1

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
                loss = self.train_loss_fn(self.model, inputs, targets)
            # Each micro-batch has the same token count, so the mean of means is the batch mean;
            # FSDP averages over ranks in its reduce-scatter.
            (loss / self.accum_steps).backward()
            step_loss += loss.detach() / self.accum_steps
        # The LR this update uses, for the log: a number now (8-bit AdamW's is a tensor the schedule refills).
        self.lr = float(self.optimizer.param_groups[0]["lr"])
        # The update. Hooks on the optimizer run around it: before, a background save's copy of the
        # weights completes (checkpoint); after, float8 updates its scales. training.nonfinite = skip
        # decides on the device whether to update: no host sync on GPU.
        grad_norm, skipped = clip_and_step(self.optimizer, list(self.model.parameters()), self.cfg.training.max_norm,
                                           skip_nonfinite=self.cfg.training.nonfinite == "skip")
        self.scheduler.step()
        self.state.step += 1
        self.state.tokens_seen += self.global_batch * self.cfg.data.seq_len
        local_tokens = self.accum_steps * self.cfg.training.local_batch_size * self.cfg.data.seq_len  # this rank's
        self.metrics.add_tokens(local_tokens, data_wait)
        self._window_losses.append(torch.stack([step_loss, grad_norm.float(), skipped]))
        return grad_norm

    def global_mean(self, values: torch.Tensor) -> torch.Tensor:
        if self.dims.sharded:
            values = values.clone()
            dist.all_reduce(values)  # gloo has no AVG: sum, then divide
            values /= self.dims.world_size
        return values

    def check_losses(self) -> float | None:
        """Reduce the (loss, grad norm, skipped) rows since the last check over ranks and act on the
        verdict of training.nonfinite (run/nonfinite.py): go on, count skipped updates, roll back, or
        stop. Return the last loss, or None after a rollback. One host sync per check, none per step."""
        rows = self.global_mean(torch.stack(self._window_losses)).tolist()
        self._window_losses = []
        verdict = self.nonfinite.judge(rows, self.state.step - len(rows) + 1, self.state.skipped_steps)
        self.state.skipped_steps += verdict.skipped
        if verdict.rollback_to is not None:
            self.rollback(verdict)
        return verdict.loss

    def losses_are_finite(self) -> bool:
        """Asked by the checkpoint manager before it saves: the steps since the last check are checked
        now, so the weights of a diverged run are never saved (False: it rolled back instead)."""
        return not self._window_losses or self.check_losses() is not None

    def rollback(self, verdict: Verdict) -> None:
        """Reload the checkpoint the verdict names (model, optimizer, LR schedule, step count) but keep
        reading data from where the loader is, so the batches read since that checkpoint, the
        offending one among them, are never replayed."""
        assert verdict.rollback_to is not None and verdict.cause is not None, "a rollback verdict names both"
        target, (step, what, value), times = verdict.rollback_to, verdict.cause, verdict.in_a_row
        read = self.state.step + self.state.data_offset  # global batches read so far
        where = self.checkpoint.restore(target)
        self.state.data_offset = read - target
        self.metrics.start_window()
        if self.is_main:
            logger.warning(
                f"{what} became {value} at step {step}: rolled back to {where} ({times} of at most {MAX_IN_A_ROW} "
                f"in a row); training goes on with batch {read + 1}: the {read - target} batches read since step "
                f"{target} are not replayed")
        self.metrics.log(step, {"to_step": target, "not_replayed": read - target, "in_a_row": times}, prefix="rollback")

    def nonfinite_counts(self) -> dict:
        """For the log record: updates skipped, or batches left behind by rollbacks, so far."""
        mode = self.cfg.training.nonfinite
        if mode == "skip":
            return {"skipped_steps": self.state.skipped_steps}
        return {"batches_skipped": self.state.data_offset} if mode == "rollback" else {}

    @torch.no_grad()
    def validation_loss(self, windows) -> float:
        micro_batches = self.cfg.validation.steps * self.accum_steps  # `steps` global batches
        total = torch.zeros((), device=self.device)
        for batch in validation_batches(windows, self.cfg.training.local_batch_size, self.dp_rank, self.dims.dp,
                                        micro_batches):
            batch = batch.to(self.device)
            with self.autocast:
                total += self.loss_fn(self.model, batch[:, :-1], batch[:, 1:]).float()
        return self.global_mean(total / micro_batches).item()

    def validate(self) -> None:
        """The held-out loss; with a mixture, one record per source (quiet on the console) and their total
        weighted as the current phase mixes them (docs/data.md)."""
        losses = {name: self.validation_loss(windows) for name, windows in self.data.val.items()}
        for name, loss in losses.items() if self.data.mixed else ():
            self.metrics.log(self.state.step, {"source": name, "loss": loss, "ppl": math.exp(min(loss, 50.0))},
                             prefix="val", console=False)
        loss = sum(w * losses[name] for name, w in self.data.val_weights().items())
        self.metrics.log(self.state.step, {"loss": loss, "ppl": math.exp(min(loss, 50.0))}, prefix="val",
                         sources=losses if self.data.mixed else None)

    # ---- the loop -----------------------------------------------------------------------------------

    def train(self) -> int:
        """Train up to training.steps, or until a stop signal (run/stopping.py); returns the exit code."""
        cfg = self.cfg
        steps = cfg.training.steps
        if self.state.step >= steps:
            logger.info(f"nothing to do: the checkpoint is at step {self.state.step} and training.steps = {steps}")
            return 0
        if self.is_main:
            logger.info(f"training from step {self.state.step + 1} to {steps}; writing to {cfg.job.dump_folder}")
        first_step = self.state.step + 1
        t0 = time.perf_counter()
        self.progress = Progress(first_step, steps, self.global_batch * cfg.data.seq_len,
                                 terminal=logger.isEnabledFor(logging.INFO) and wants_terminal_line(sys.stderr))
        self.stop_signals = stop_signals = stopping.StopSignals(announce=logger.isEnabledFor(logging.INFO))
        stop_signals.install()  # from here on, preemption and Ctrl-C stop after a step, with a checkpoint
        while self.state.step < steps:
            grad_norm = self.train_step()
            step = self.state.step
            self.progress.step_done(step)
            last = step == steps
            if step == first_step or step % cfg.metrics.log_freq == 0 or last:
                loss = self.check_losses()
                if loss is None:
                    continue  # rolled back to the last checkpoint (training.nonfinite = rollback)
                record = {"loss": loss, "grad_norm": grad_norm.item(), "lr": self.lr, **self.nonfinite_counts()}
                if step == first_step:
                    # The first step pays for compilation and warm-up: report it, then start timing.
                    record["first_step_s"] = time.perf_counter() - t0
                else:
                    record.update(tokens_seen=self.state.tokens_seen, **self.metrics.throughput(),
                                  float8_matmul_share=self.metrics.float8_share)
                record.update(self.data.read_by_source())  # tokens and epochs per source (jsonl, TensorBoard)
                self.metrics.log(step, {**record, **self.metrics.memory()}, total_steps=steps,
                                 eta_s=self.progress.eta_s())
                self.progress.logged_loss(step, loss)
                if step == first_step:
                    self.metrics.start_window()
            if self.data.val and (step % cfg.validation.freq == 0 or last):
                self.validate()
            # Saves when due (interval, last step), and on a stop request agreed by every rank.
            outcome = self.checkpoint.after_step(step, last=last, stop_request=stop_signals.request)
            if self.state.step != step:
                continue  # rolled back before a save (the weights had diverged): train on from there
            if outcome.stop and not last:
                marker = os.environ.get("TITANLIKE_PREEMPTED_MARKER")
                if outcome.stop == stopping.PREEMPTED and marker and self.local_rank == 0:
                    open(marker, "w").close()  # tells run_train.sh on this node: a clean stop, exit 0
                if self.is_main:
                    logger.info(stopping.stopped_line(outcome.stop, step, outcome.saved or "(none)"))
                return stopping.EXIT_CODE[outcome.stop]
            self.profiler.step(step)
            self.progress.show()
        self.completed = True
        self.progress.close()
        if self.is_main:
            trained = f"{steps} steps" if first_step == 1 else (
                f"steps {first_step}-{steps} ({steps - first_step + 1} steps, resumed at step {first_step - 1})")
            logger.info(f"done: {trained} in {time.perf_counter() - t0:.1f}s")
        return 0

    def close(self, publish: bool = True) -> None:
        """However the run ends: the checkpoint manager publishes what is in flight (`publish`: every
        rank got here), then the records close. Parts __init__ did not get to build are skipped."""
        progress = getattr(self, "progress", None)
        if progress is not None:
            progress.close()
        if hasattr(self, "stop_signals"):
            self.stop_signals.restore()
        try:
            if hasattr(self, "checkpoint"):
                self.checkpoint.close(completed=getattr(self, "completed", False), publish=publish)
        finally:
            for part in ("profiler", "metrics", "run_folder"):
                if hasattr(self, part):
                    getattr(self, part).close()


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
    parallel.default_allocator_settings()
    world, rank, _ = world_from_env()
    setup_logging(rank)
    trainer = cfg = None
    argv = list(sys.argv[1:] if argv is None else argv)
    publish = True  # whether every rank reaches the end together (a failure of one rank alone: no)
    try:
        if any(a in ("-h", "--help") for a in argv):
            if rank == 0:
                print(help_text())
            return 0
        cfg = load_config(argv)
        if cfg.job.print_config:
            if rank == 0:
                print(to_toml(resolved(cfg)), end="")
            return 0
        trainer = Trainer(cfg)
        return trainer.train()
    except KeyboardInterrupt:
        # Ctrl-C before the training loop (building, compiling, loading): nothing trained to save.
        if rank == 0:
            print("interrupted before training started: nothing saved", file=sys.stderr)
        publish = world == 1
        return stopping.EXIT_CODE[stopping.INTERRUPTED]
    except UserError as e:
        if rank == 0 or not e.same_on_all_ranks:
            print(f"error: {e}", file=sys.stderr)
        publish = world == 1 or e.same_on_all_ranks
        return 2
    except RuntimeError as e:  # out of memory, or a peer rank gone: one line where it is one of those
        publish = world == 1
        known = faults.explain(e, cfg, trainer, world, rank)
        if known is None:
            raise
        print(f"error: {known[1]}", file=sys.stderr)
        return known[0]
    except BaseException:
        publish = world == 1
        raise
    finally:
        if trainer is not None:
            try:
                trainer.close(publish=publish)
            except UserError as e:  # publishing the save in flight failed: say so, after the first error
                print(f"error: {e}", file=sys.stderr)
        if dist.is_initialized():
            parallel.destroy_process_group()


def cli() -> None:
    """The `titanlike-train` console script: same as `python -m titanlike.train`."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
