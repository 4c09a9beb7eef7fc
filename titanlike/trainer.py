"""The trainer: build everything from the config, then run training steps.

Read top to bottom, this file is the story of a run: where it runs, what data it reads, how the
model is built (meta → converters → parallelize: cp, activation checkpointing, compile, FSDP → init),
what resumes it, how one step goes (micro-batches, the update), and what follows each step, in order: the non-finite
check, the log record, validation, the checkpoint, a stop. Each component owns its lifecycle and is
called at a few points; none calls back into the trainer. The command around it (train.py) turns
anything the user can fix into one line on stderr and exit code 2.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import torch

from titanlike import overrides, parallel
from titanlike.checkpoint.manager import CheckpointManager, SavedParts
from titanlike.config import ConfigError, JobConfig, to_toml
from titanlike.config.dims import local_world, world_from_env
from titanlike.config.run import resolve_run
from titanlike.converters import build_converters
from titanlike.data.build import DataSpec, build_run_data
from titanlike.data.loader import validation_batches, validation_clamp_line, validation_steps
from titanlike.data.tokenizer import record_tokenizer, run_tokenizer_files
from titanlike.hf.initial import load_initial_weights
from titanlike.model.converter import ConvertArgs
from titanlike.model.decoder import Transformer
from titanlike.model.loss import build_loss
from titanlike.model.shape import count_params, describe, flops_per_token
from titanlike.optim import build_optimizer, build_scheduler, clip_and_step, update_rms
from titanlike.plan.estimate import cpu_host_problem
from titanlike.records import wandb_sink
from titanlike.records.folder import RunFolder
from titanlike.records.metrics import MetricsLogger, StepTimer
from titanlike.records.profiling import Profiler
from titanlike.records.progress import Progress, wants_terminal_line
from titanlike.run import stopping
from titanlike.run.nonfinite import NonFiniteGuard, Verdict
from titanlike.run.source_losses import SourceLosses
from titanlike.run.stage import RunStages
from titanlike.run.state import TrainState

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
        self._place()
        self._build_data()
        self._build_model()
        self._build_optimizer()
        resumed = self._resume()
        self._build_records(resumed)
        self._say_what_runs()
        self.progress: Progress | None = None  # made when the loop starts (train())

    def _place(self) -> None:
        """1. Where we run: the resolved run, ranks, device, mesh, the run folder."""
        cfg, t = self.cfg, self.cfg.training
        world, rank, local_rank = world_from_env()
        # The shape, degrees, batch plan, sources, phases and stages: resolved once, as the preflight checked them.
        self.run = resolve_run(cfg, world)
        if cfg.metrics.enable_wandb:
            wandb_sink.check_installed()  # before any work, as the preflight does
        self.dims, self.local_rank, self.rank, self.world = self.run.dims, local_rank, rank, world
        self.is_main = rank == 0
        self.device = parallel.pick_device(t.device, local_rank)
        if self.device.type == "cpu" and (problem := cpu_host_problem(cfg, world, local_world(), self.run.model.args)):
            raise ConfigError(problem)  # the preflight's check, for a run started without run_train.sh
        parallel.configure_device(self.device, t.gpu_memory_limit_gib, t.deterministic)
        offload = cfg.parallel.cpu_offload
        self.mesh = parallel.init_distributed(self.dims, self.device, cfg.parallel.backend_timeout_s,
                                              cpu_offload=offload)
        # Offloaded: the host must hold the state the GPU gives up, before any model is built.
        parallel.offload.prepare_host(offload, self.device, count_params(self.run.model.args)[0],
                                      self.dims.fsdp_shard, cfg.optimizer.state_dtype,
                                      cfg.checkpoint.enable and cfg.checkpoint.async_mode != "disabled",
                                      log=self.is_main)
        torch.manual_seed(cfg.job.seed)
        # The dump folder is this run's alone (a lock; checked writable before any work).
        self.run_folder = RunFolder(cfg.job.dump_folder, self.is_main)
        if self.is_main:
            logger.info(f"run folder {os.path.abspath(cfg.job.dump_folder)}: the config, metrics and "
                        f"{'checkpoints' if cfg.checkpoint.enable else 'logs'} of this run go there")
            for note in self.run.notes:
                logger.info(note)
            busy = parallel.cpu_threads_note(self.device)  # compute threads on cores that other work holds
            if busy:
                logger.warning(busy)

    def _build_data(self) -> None:
        """2. Data: every rank reads its own slice of each global batch, at the stage's seq_len."""
        cfg = self.cfg
        self.margs = self.run.model.args
        # The stage (seq_len, RoPE base, batch) and the numbers that follow from it, owned in one place.
        self.stages = RunStages(self.run.stages, flops_per_token=lambda seq: flops_per_token(self.margs, seq),
                                cp=self.dims.cp, compiled=cfg.compile.enable, is_main=self.is_main)
        # The cp ranks of a data-parallel group read the same samples (each keeps its part of every sequence).
        self.dp_rank = self.dims.dp_rank(self.rank)
        # One source (data.path) or a mixture (data.mix): each source's windows, the plan of which
        # source and window every global position reads, and the loader over it (data/build.py);
        # with stages, each seq_len's windows.
        self.data = build_run_data(DataSpec.of_run(self.run, self.dp_rank, pin_memory=self.device.type == "cuda"))
        self.loader = self.data.loader
        missing = self.data.missing_validation() if cfg.validation.enable else None
        if self.is_main and missing:
            logger.info(missing)

    def _build_model(self) -> None:
        """3. Model: meta → converters → cp → AC → compile → FSDP → materialise → init, at the first stage."""
        cfg, t, first = self.cfg, self.cfg.training, self.stages.first
        # Which overrides of torch/torchao internals run (parallel.overrides, each probed): one line.
        overrides_line = overrides.configure(cfg.parallel.overrides)
        if self.is_main:
            logger.info(overrides_line)
        with torch.device("meta"):  # block_causal splits documents at document_end
            model = Transformer(self.margs, document_end=self.run.model.document_end)
        # The model converters the config turns on (titanlike/converters.py's registry), in order.
        self.converters = build_converters(self.run)
        self.converters.convert(model, ConvertArgs(
            device=self.device, batch=first.local_batch, seq_len=first.rank_seq_len,
            flops_per_token=first.flops_per_token, block_sample=model.sample_block, compiled=cfg.compile.enable))
        # cp → AC → compile → FSDP (or autocast on one rank), in that order (parallel/apply.py).
        spread = parallel.parallelize(model, self.dims, cfg, device=self.device, mesh=self.mesh,
                                      compile_options=self.converters.compile_options(), log=self.is_main)
        self.autocast, self.context = spread.autocast, spread.context
        offload = cfg.parallel.cpu_offload
        # Offloaded, the weights live in host memory but are drawn on the GPU (the numbers of a run
        # without offload), and the buffers (rotary tables) stay on the GPU, where the forward reads them.
        model.to_empty(device=parallel.offload.param_device(self.device, offload))
        model.init_weights(cfg.job.seed, first.seq_len, device=self.device)
        parallel.offload.buffers_to(model, self.device)
        self.model = model
        # loss_fn(model, inputs, targets): over whole logits, or chunk by chunk (training.loss_chunk_tokens);
        # on one process, compiled, the final norm + output layer + loss are one graph (model/loss.py).
        self.loss_fn = build_loss(t.loss_chunk_tokens, cfg.compile.enable, compile_head=self.mesh is None)

    def _build_optimizer(self) -> None:
        """4. Optimizer, LR schedule and the run's counters."""
        cfg = self.cfg
        o, s = cfg.optimizer, cfg.lr_scheduler
        # optimizer.name's builder (optim/__init__.py's registry), from the [optimizer] section.
        self.optimizer = build_optimizer(self.model, o, self.device.type, host_params=cfg.parallel.cpu_offload)
        self.scheduler = build_scheduler(self.optimizer, s, cfg.training.steps)
        self.state = TrainState()

    def _resume(self) -> int | None:
        """5. Checkpoints: resume from the newest intact one, if any; else the initial weights, if any.
        Returns the step resumed from."""
        cfg = self.cfg
        # The run's tokenizer goes into its folder and into every step folder, for the export.
        self.tokenizer_files = run_tokenizer_files(self.run.model.dataset, builtin_corpus=self.run.builtin_corpus)
        self.checkpoint = CheckpointManager(
            self.run, SavedParts(self.model, self.optimizer, self.scheduler, self.loader, self.state,
                                 self.converters.states),
            shape_after=lambda batches_read: self.run.stages.args_after(self.margs, batches_read),
            is_main=self.is_main, cuda=self.device.type == "cuda", folder_run=self.run_folder.run_id,
            step_files=self.tokenizer_files)
        # A step saved by another run than this folder's is resumed from only when load_step names it.
        resumed = self.checkpoint.load_or_start()
        if resumed is None and cfg.checkpoint.initial_load_path:
            load_initial_weights(self.model, self.margs, cfg.checkpoint.initial_load_path,
                                 trust_pickled_dcp=cfg.checkpoint.trust_pickled_dcp, is_main=self.is_main)
        return resumed

    def _build_records(self, resumed: int | None) -> None:
        """6. Records, metrics, profiling and what judges each step: one run's history per folder."""
        cfg, t = self.cfg, self.cfg.training
        purge_step = self.run_folder.start_records(resumed, self.checkpoint.run.run_id,
                                                   branched=self.checkpoint.branched)
        if self.is_main:  # after an earlier run's records (its tokenizer among them) moved away
            record_tokenizer(self.tokenizer_files, cfg.job.dump_folder)
        self.run_folder.write("config.toml", to_toml(self.run.resolved_config()))
        self.metrics = MetricsLogger(
            cfg.job.dump_folder, is_writer=self.is_main, tensorboard=cfg.metrics.enable_tensorboard,
            device=self.device, constants=self.converters.record(), purge_step=purge_step,
            wandb=(cfg.metrics.wandb_project, cfg.metrics.wandb_name) if cfg.metrics.enable_wandb else None)
        if resumed is not None:  # the first record of this process says so (scripts/plot_metrics.py marks it)
            self.metrics.note({"resumed_from": resumed})
        # The converters follow the weights (initialised or loaded), and act after each update (their scales).
        self.converters.attach(self.optimizer, counters=self.state, metrics=self.metrics)
        self.profiler = Profiler(cfg.profiling, cfg.job.dump_folder, self.rank, self.device,
                                 start_step=self.state.step)
        # What a non-finite loss does (training.nonfinite): judged over the steps since the last check.
        self.guard = NonFiniteGuard(t.nonfinite, complete_steps=self.checkpoint.complete_steps,
                                    step_dir=self.checkpoint.step_dir, counters=self.state, is_main=self.is_main)
        self.window: list[torch.Tensor] = []  # (loss, grad norm, skipped) of those steps, on the device
        # The CPU no more than one update ahead of the GPU; with cp, and a quarter of the forward.
        self.fence = parallel.StepFence(self.device, hold_in=self.model if self.dims.cp > 1 else None)
        # A mixture also logs each source's training loss: the same loss, with each token's loss read
        # beside it (detached) and summed by source (run/source_losses.py). One source: loss_fn alone.
        self.source_losses = SourceLosses(
            self.data.names, self.device,
            build_loss(t.loss_chunk_tokens, self.cfg.compile.enable, compile_head=self.mesh is None, per_token=True),
        ) if self.data.mixed else None

    def _say_what_runs(self) -> None:
        """The one line that says what trains where (and one when validation.steps is past the held-out data)."""
        if not self.is_main:
            return
        first, d = self.stages.first, self.dims
        n_params = sum(p.numel() for p in self.model.parameters())
        bf16_sums = parallel.reduce_dtype(self.cfg.training.mixed_precision_reduce, self.mesh) == torch.bfloat16
        logger.info(
            f"model {self.run.model.name}: {n_params / 1e6:,.1f}M parameters ({describe(self.margs)}) | "
            f"{self.world} rank(s) on {self.device.type} "
            f"(dp_replicate {d.dp_replicate} × dp_shard {d.dp_shard}{f' × cp {d.cp}' if d.cp > 1 else ''}) | "
            f"global batch {first.global_batch} = {first.local_batch} × {d.dp} ranks × {first.accum_steps} "
            f"micro-batches | seq {first.seq_len}{' | gradients summed in bf16' if bf16_sums else ''}"
            f"{' | gradients summed once a step' if self.cfg.parallel.gradient_sync == 'step' and self.mesh else ''}")
        if self.data.val and (line := validation_clamp_line(
                {name: len(w) for name, w in self.data.val.items()},
                self.run.stages.at_batch(self.loader.batches_read).global_batch, self.cfg.validation.steps,
                named=self.data.mixed)):
            logger.info(line)  # validation.steps past the held-out data: read once (data/loader.validation_steps)

    # ---- one training step ----------------------------------------------------------------------

    def train_step(self, timed: bool = False) -> torch.Tensor:
        """Forward and backward over the micro-batches of one global batch, then one update; `timed` (a log
        step): the update's share of the step's time, in self.timer."""
        self.fence.step_start()
        self.timer = StepTimer(self.device) if timed else None
        self.optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), device=self.device)
        data_wait = 0.0
        stage = self.stages.current
        accum_steps = stage.accum_steps
        if self.source_losses is not None:
            self.source_losses.start_step()
        once_a_step = self.cfg.parallel.gradient_sync == "step"
        for i in range(accum_steps):
            if once_a_step:  # the ranks sum the gradients in the last micro-batch's backward only
                parallel.sync_after(self.model, last=i == accum_steps - 1)
            start = time.perf_counter()
            sources = self.data.next_sources() if self.source_losses is not None else None
            batch = next(self.loader).to(self.device, non_blocking=True)
            data_wait += time.perf_counter() - start
            inputs, targets, context = self.micro_batch(batch)
            with self.autocast:
                if self.source_losses is not None:
                    loss = self.source_losses.loss(self.model, inputs, targets, sources, context)
                else:
                    loss = self.loss_fn(self.model, inputs, targets, context)
            # Each micro-batch has the same token count, so the mean of means is the batch mean;
            # FSDP averages over ranks in its reduce-scatter.
            (loss / accum_steps).backward()
            step_loss += loss.detach() / accum_steps
        self.fence.backward_queued()
        # The LR this update uses, for the log: a number now (an optimizer may keep a tensor the schedule refills).
        self.lr = float(self.optimizer.param_groups[0]["lr"])
        # The update overwrites the weights: a background save's copy of them must be complete first.
        self.checkpoint.before_update()
        # Clip and update (the converters act after it, in their hook). training.nonfinite =
        # skip reads on the host whether to update: one host sync a step, with skip only.
        if self.timer:
            self.timer.mark()
        grad_norm, skipped = clip_and_step(self.optimizer, list(self.model.parameters()), self.cfg.training.max_norm,
                                           skip_nonfinite=self.cfg.training.nonfinite == "skip")
        if self.timer:
            self.timer.mark()
        self.scheduler.step()
        self.state.step += 1
        self.state.tokens_seen += stage.tokens_per_step
        # This rank's tokens (with cp, its part of each sequence), at the stage's FLOPs per token.
        self.metrics.add_tokens(stage.rank_tokens_per_step, data_wait, stage.flops_per_token)
        # Offloaded, the gradients (so their norm) are on the host: gather the step's numbers on the device.
        self.window.append(torch.stack([step_loss, grad_norm.float().to(self.device), skipped.to(self.device)]))
        return grad_norm

    def micro_batch(self, batch: torch.Tensor):
        """(inputs, targets, context) of a micro-batch of windows: whole, or with context parallelism this
        rank's part of each and its SequenceShard (positions, attention's mask)."""
        inputs, targets = batch[:, :-1], batch[:, 1:]
        if self.context is None:
            return inputs, targets, None
        return self.context.shard(inputs, targets, self.model.document_end)

    @torch.no_grad()
    def validation_loss(self, windows) -> float | None:
        """The mean loss of the leading global batches of `windows` (validation.steps of them, each window
        read at most once); None when a stop request came first (any rank's: checked before each global
        batch, so that a long validation does not hold up a preemption)."""
        stage = self.stages.current
        accum = stage.accum_steps
        micro_batches = validation_steps(len(windows), stage.global_batch, self.cfg.validation.steps) * accum
        total = torch.zeros((), device=self.device)
        for i, batch in enumerate(validation_batches(windows, stage.local_batch, self.dp_rank, self.dims.dp,
                                                     micro_batches)):
            if i % accum == 0 and self.stop_requested():
                return None
            inputs, targets, context = self.micro_batch(batch.to(self.device))
            with self.autocast:
                total += self.loss_fn(self.model, inputs, targets, context).float()
        return parallel.mean_over_ranks(total / micro_batches).item()

    def stop_requested(self) -> bool:
        """Whether any rank has a stop request; every rank calls it at the same points (one small
        all-reduce with more than one rank)."""
        request = float(self.stop_signals.request)
        if self.world > 1:
            request = parallel.mean_over_ranks(torch.tensor(request, device=self.device)).item()
        return request > 0

    def validate(self) -> None:
        """The held-out loss of each source with validation data; with a mixture, their total weighted as
        the current phase mixes them (docs/data.md). Cut short by a stop request, it logs nothing: the
        loop's next agreement on a stop (CheckpointManager.due) saves and stops the run."""
        losses = {}
        for name, windows in self.data.val.items():
            if (loss := self.validation_loss(windows)) is None:
                return
            losses[name] = loss
        self.metrics.log_validation(self.state.step, losses, self.data.val_total(losses), per_source=self.data.mixed)

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
        self.progress = Progress(first_step, steps, self.stages.current.tokens_per_step,
                                 terminal=logger.isEnabledFor(logging.INFO) and wants_terminal_line(sys.stderr))
        self.stop_signals = stopping.StopSignals(announce=logger.isEnabledFor(logging.INFO))
        self.stop_signals.install()  # from here on, preemption and Ctrl-C stop after a step, with a checkpoint
        self.metrics.begin()
        while self.state.step < steps:
            self.enter_stage()
            step = self.state.step + 1
            last = step == steps
            log = step == first_step or step % cfg.metrics.log_freq == 0 or last
            grad_norm = self.train_step(timed=log)
            self.progress.step_done(step)
            # Every rank agrees on how this step ends: saved (interval, last step, a stop request) or not.
            due = self.checkpoint.due(step, last=last, stop_request=self.stop_signals.request)
            if log or due.save:
                # The steps since the last check, judged before anything is logged or saved: the weights
                # of a diverged run are never saved. One host sync per check, none per step.
                verdict = self.guard.check(parallel.mean_over_ranks(torch.stack(self.window)).tolist())
                self.window = []
                self.state.skipped_steps += verdict.skipped
                if verdict.rollback_to is not None:  # training.nonfinite = rollback
                    verdict = self.roll_back(verdict)
                    self.metrics.start_window()
                    self.metrics.log(verdict.bad_step, verdict.rollback_record(), prefix="rollback")
                    continue
                if log:
                    assert verdict.loss is not None, "a verdict that goes on carries the last loss"
                    # The optimizer's share of the step's time, and its update RMS by kind where it measures one
                    # (a collective: every rank logs this step).
                    record = {"loss": verdict.loss, "grad_norm": grad_norm.item(), "lr": self.lr,
                              **self.guard.counts(), **self.stages.record(), **update_rms(self.optimizer),
                              **(self.timer.record() if self.timer else {})}
                    if self.source_losses is not None:  # a mixture: each source's loss in this step
                        record["loss_by_source"] = self.source_losses.reduce()
                    self.metrics.log_train(step, record, tokens_seen=self.state.tokens_seen,
                                           by_source=self.data.read_by_source(),  # tokens and epochs per source
                                           total_steps=steps, eta_s=self.progress.eta_s())
                    self.progress.logged_loss(step, verdict.loss)
            if self.data.val and (step % cfg.validation.freq == 0 or last):
                self.validate()
            saved = self.checkpoint.save(step, due) if due.save else None
            if due.stop and not last:
                return stopping.stopped(due.stop, step, saved, local_rank=self.local_rank, is_main=self.is_main)
            self.profiler.step(step)
            self.progress.show()
        self.completed = True
        self.progress.close()
        if self.is_main:
            trained = f"{steps} steps" if first_step == 1 else (
                f"steps {first_step}-{steps} ({steps - first_step + 1} steps, resumed at step {first_step - 1})")
            logger.info(f"done: {trained} in {time.perf_counter() - t0:.1f}s")
        return 0

    def enter_stage(self) -> None:
        """Before a step: the stage of the next global batch. When it is another than the model's (a
        long-context stage begins, or this process resumed in one), the stage has switched the model's
        rotary tables; throughput and progress count the new stage's tokens from here."""
        switched = self.stages.enter(self.loader.batches_read, self.model)
        if switched is None:
            return
        self.metrics.start_window()  # tokens/s and MFU over one stage's steps, never a mix of two
        assert self.progress is not None, "made before the loop"
        self.progress.new_stage(switched.tokens_per_step)

    def roll_back(self, verdict: Verdict) -> Verdict:
        """training.nonfinite = rollback: reload the verdict's checkpoint (weights, optimizer, schedule,
        counters) while the data reads on from where it is, so the batches read since, the offending one
        among them, are never replayed."""
        assert verdict.rollback_to is not None, "a rollback verdict"
        read = self.state.batches_read
        where = self.checkpoint.restore(verdict.rollback_to)
        self.state.data_offset = read - verdict.rollback_to
        return self.guard.rolled_back(verdict, where, read)

    def fault_facts(self) -> dict:
        """What a failure's one line needs to know of the run (run/faults.explain)."""
        return {"step": self.state.step, "device": self.device, "dims": self.dims,
                "oom_snapshot": self.profiler.oom_snapshot,
                "stage": self.stages.current.stage if hasattr(self, "stages") else None}

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
