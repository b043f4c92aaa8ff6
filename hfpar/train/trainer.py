"""The one training loop behind every recipe and every composition (the backend holds what differs).

    trainer = Trainer(args, accelerator, ctx, backend, model, tokenizer, train_ds, eval_ds, collator, plan, objective)
    trainer.train()

plan: the run's RunPlan (hfpar.context); objective: an hfpar.objectives.base.Objective, whose declared hooks the
loop calls (the units the loss is normalized by, per-sample hooks, metrics, eval).

Loss normalization (the parity contract): the optimized and logged loss of an optimizer step is
    sum of per-token losses over the whole global batch / number of real target tokens in it
(all dp ranks, all accumulation steps). Each rank back-propagates local_sum * (dp * accum) / N_global:
Accelerate divides by `accum` and the data-parallel backends average over dp, which leaves exactly
d(global_sum / N_global). Unequal sequence lengths or masks therefore do not bias the loss, unlike
a mean of per-micro-batch means.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from hfpar.backends.optim import implementation
from hfpar.checkpoint.checkpointer import Checkpointer
from hfpar.checkpoint.layout import run_identity
from hfpar.distributed import all_reduce_sum
from hfpar.observe import metrics as M
from hfpar.observe.comm_stats import StepCommLog
from hfpar.observe.recorder import RunRecorder
from hfpar.parallel.labels import IGNORE
from hfpar.train.batch_plan import BatchPlan
from hfpar.train.compile import compile_seconds
from hfpar.train.prefetch import StepBatches, StepLoader, pin_and_copy
from hfpar.train.sampler import GlobalBatchSampler, eval_shard, total_steps
from hfpar.train.schedules import get_scheduler


class NonFiniteError(RuntimeError):
    pass


def attention_kernels(device: torch.device):
    """SDPA's kernels for a run, as a context: on CUDA flash, memory-efficient and math (not cuDNN attention);
    on CPU SDPA's own choice. why: docs/architecture.md#why-the-training-loop"""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


class Trainer:
    def __init__(
        self,
        args,
        accelerator,
        ctx,
        backend,
        model,
        tokenizer,
        train_dataset,
        eval_dataset,
        collator,
        plan,
        objective,
        run_extra: dict | None = None,
    ):
        """plan: the RunPlan (hfpar.context); objective: what the loop optimizes, an hfpar.objectives.base.Objective
        (not imported here: objectives/ builds on train/'s losses; the loop calls only the hooks it declares)."""
        assert plan.task in ("lm", "classify")
        self.args, self.acc, self.ctx, self.backend = args, accelerator, ctx, backend
        self.tokenizer, self.collator, self.task = tokenizer, collator, plan.task
        self.train_ds, self.eval_ds = train_dataset, eval_dataset
        self.objective = objective
        self.batch_plan = BatchPlan(plan.task, ctx, plan.cp_mode)
        # a pipeline micro-batch over the dp ranks: one contiguous slice of the batch
        self.sampler = GlobalBatchSampler(
            len(train_dataset),
            args.per_device_train_batch_size,
            ctx.dp,
            ctx.dp_rank,
            args.gradient_accumulation_steps,
            args.seed,
            splits=plan.microbatches,
        )
        self.total_steps = total_steps(args.max_steps, args.num_train_epochs, self.sampler.steps_per_epoch)
        warmup = args.warmup_steps or math.ceil(args.warmup_ratio * self.total_steps)
        # metrics.jsonl, run_info.json, trackers, console, report.png; counts the parameters before any wrap
        self.recorder = RunRecorder(
            accelerator,
            ctx,
            args.output_dir,
            model,
            total_steps=self.total_steps,
            global_batch=self.sampler.global_batch,
            logging_steps=args.logging_steps,
            report_to=args.report_to,
            run_extra=run_extra,
        )
        self.comm = StepCommLog(model) if args.log_comm_bytes else None  # before the backend wraps
        backend.prepare(
            model
        )  # plain FSDP2 from a checkpoint: each rank's shards are read here (hfpar.loading.sharded)
        self.model, self.optimizer = backend.model, backend.optimizer
        self.recorder.model_ready(backend, implementation)
        # Stepped by us once per optimizer step (not prepared: Accelerate's wrapper would step it num_processes
        # times per call) and saved with the checkpoint.
        self.scheduler = get_scheduler(
            args.lr_scheduler_type, backend.base_optimizer, num_warmup_steps=warmup, num_training_steps=self.total_steps
        )
        if self.comm is not None:
            self.comm.watch(self.model)
        # checkpoint-<step>/ layout, trainer state, cadence, retention, resume, the final export
        self.checkpointer = Checkpointer(
            accelerator,
            ctx,
            backend,
            args.output_dir,
            total_steps=self.total_steps,
            save_steps=args.save_steps,
            save_total_limit=args.save_total_limit,
            resume=args.resume_from_checkpoint,
            seed=args.seed,
            global_batch=self.sampler.global_batch,
            pp_virtual_stages=plan.chunks_per_rank,
            tokenizer=tokenizer,
            peft=args.use_peft,
            merge_adapter=args.merge_adapter,
            identity=run_identity(args),
        )
        self.checkpointer.register(self.scheduler, objective)
        self.start_step = 0
        # the copies of prefetched batches run on a stream of their own (CUDA); the step's counts are all-reduced
        # on the device only where there is another rank to reduce with (one process: no device round trip)
        self._copy_stream = torch.cuda.Stream(accelerator.device) if accelerator.device.type == "cuda" else None
        multi = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        self._count_device = accelerator.device if multi else torch.device("cpu")
        objective.bind(self.model)  # e.g. a frozen reference: a copy of the parameters as the backend holds them

    # ------------------------------------------------------------------ forward
    def _to_device(self, batch: dict) -> dict:
        return {k: v.to(self.acc.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}

    def _train_batches(self):
        """Every micro-batch of the run, in order: (dataset indices, plan() -> (planned batch, scope))."""
        for _, _, micro in self.sampler.iterate(0, self.total_steps):
            for ix in micro:
                yield ix, lambda ix=ix: self.batch_plan(self._to_device(self.collator([self.train_ds[i] for i in ix])))

    def _eval_indices(self):
        """This rank's eval batches, by dataset index (None: a padding slot; every rank the same number)."""
        if self.eval_ds is None or len(self.eval_ds) == 0:
            return
        n = min(len(self.eval_ds), self.args.max_eval_samples or len(self.eval_ds))
        yield from eval_shard(n, self.args.per_device_eval_batch_size, self.ctx.dp, self.ctx.dp_rank)

    def _eval_batches(self):
        """The eval batches as they are, padding slots included: (indices, plan() -> (planned batch, scope))."""
        for idx in self._eval_indices():
            feats = [dict(self.eval_ds[i if i is not None else 0]) for i in idx]
            yield idx, lambda feats=feats: self.batch_plan(self._to_device(self.collator(feats)))

    # ------------------------------------------------------------------ eval
    @torch.no_grad()
    def evaluate(self) -> dict:
        if self.eval_ds is None or len(self.eval_ds) == 0:
            return {}
        own = self.objective.evaluate(self.backend, list(self._eval_indices()), self.eval_ds)
        if own is not None:
            return own
        self.model.eval()
        stats = torch.zeros(3, dtype=torch.float64, device=self.acc.device)  # loss sum, targets, correct
        obj = self.objective
        obj.begin_eval()
        for idx in self._eval_indices():
            feats = []
            for i in idx:
                f = dict(obj.sample("eval", i if i is not None else 0, self.eval_ds[i if i is not None else 0]))
                feats.append(f if i is not None else obj.padding_sample(f))  # padding slot: same shapes, no targets
            raw = self._to_device(self.collator(feats))
            batch, scope = self.batch_plan(raw)
            obj.before_micro(self.backend, batch, lambda raw=raw: self.batch_plan(raw))
            ls, cnt, logits = self.backend.eval_loss(batch, scope, obj, self.task)
            stats[0] += ls.double()
            stats[1] += cnt.double()
            if self.task == "classify":
                lab = batch["labels"]
                stats[2] += ((logits.argmax(-1) == lab) & (lab != IGNORE)).sum().double()
        stats = all_reduce_sum(stats, self.acc.device) / self.ctx.data_replicas  # replicas counted the same rows
        self.model.train()
        out = {"eval_loss": float(stats[0] / stats[1].clamp(min=1))}
        if self.task == "classify":
            out["eval_accuracy"] = float(stats[2] / stats[1].clamp(min=1))
        out.update(obj.end_eval(self.acc.device))
        return out

    # ------------------------------------------------------------------ train
    def _load_step(self, step: int, micro: list) -> StepBatches:
        """An optimizer step's micro-batches (the objective's samples of the sampler's rows), collated, counted and
        copied to the device; on the host only, so that it can run ahead of the step (hfpar.train.prefetch)."""
        obj = self.objective
        feats = obj.step_samples(self.backend, step, micro, self.train_ds)  # rollouts: generated here (not ahead)
        host = [self.collator(f) for f in feats]
        # the units of each planned micro-batch (planned on the host: the same rows, cut the same way)
        units = sum(obj.count(self.batch_plan(b)[0]) for b in host)
        # real (non-pad) tokens, whatever the rows' layout; the cp ranks of a replica hold the same samples
        real = sum(obj.tokens(x) for f in feats for x in f) / self.ctx.cp
        device, done = pin_and_copy(host, self.acc.device, self._copy_stream)
        return StepBatches(device, done, units, real)

    def _train_step(self, step: int, loaded: StepBatches, t0: float, c0: float) -> dict:
        """One optimizer step over the accumulation steps' micro-batches (loaded: _load_step's, on the device;
        t0, c0: when the loop asked for them, wall and CPU clocks); returns its metrics record."""
        args, acc, ctx = self.args, self.acc, self.ctx
        if self.comm is not None:
            self.comm.reset()
        obj = self.objective
        # collated, counted and copied on the host, ahead of this step where the samples come from the data
        raw = loaded.device
        batches = [self.batch_plan(b) for b in raw]
        # the loss units and real tokens were counted on the host (no device read): one collective, read once
        totals = all_reduce_sum([loaded.units, loaded.real], self._count_device) / ctx.data_replicas
        n_units = n_global = float(totals[0])
        if n_global == 0:  # the objective decides: a data bug (raises) or a zero-loss step (online RL)
            n_global = float(obj.empty_step_units(step))
        step_loss = torch.zeros((), dtype=torch.float64, device=acc.device)
        loss_scale = (
            self.backend.loss_scale()
        )  # fp16: the scale this step's backwards use (DeepSpeed updates it in them)
        for (batch, scope), r in zip(batches, raw):
            # replan: a scope is entered once, and the hook may run a forward (a reference model's)
            obj.before_micro(self.backend, batch, lambda r=r: self.batch_plan(r))
            # the backend averages grads over dp x cp ranks: this scale leaves exactly d(global loss sum / N_global)
            step_loss += self.backend.train_micro(batch, scope, obj, ctx.grad_replicas / n_global, self.task).double()
        # the loss and the objective's metric sums (DPO's rewards): one collective a step, read after the clip
        # (whose norm is read anyway), so the step waits on the device once
        sums = all_reduce_sum(torch.cat([step_loss.view(1), obj.step_sums(acc.device)]), acc.device)
        max_norm = args.max_grad_norm if args.max_grad_norm > 0 else float("inf")
        grad_norm = self.backend.clip(max_norm)
        sums = sums.tolist()
        loss = sums[0] / ctx.data_replicas / n_global
        # fp16: overflowed grads are the loss scaler's business (it skips the step on every rank, lowers its scale)
        overflow = self.backend.overflowed(grad_norm)
        bad = not overflow and (
            not math.isfinite(loss) or (not self.backend.steps_in_backward and not math.isfinite(grad_norm))
        )
        if bad and args.on_nonfinite == "error":
            raise NonFiniteError(
                f"step {step + 1}: non-finite loss {loss} or grad_norm {grad_norm}; stopping before the optimizer step"
            )
        lr = self.scheduler.get_last_lr()[0]
        if not bad:
            self.backend.step(lr)
        with warnings.catch_warnings():  # DeepSpeed steps its optimizer inside backward; the order is right
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()`")
            self.scheduler.step()
        self.backend.zero_grad()
        dt = time.perf_counter() - t0
        rec = {
            "step": step + 1,
            "epoch": round(step / self.sampler.steps_per_epoch, 4),
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": float(totals[1]) / dt,
            "step_time_s": dt,
            "step_cpu_s": time.process_time() - c0,  # this process's CPU seconds (all its threads)
            "num_target_tokens": int(n_units),
            "peak_mem_bytes": M.peak_memory_bytes(acc.device),
        }
        rec.update(obj.metrics(sums[1:]))
        if bad or overflow:
            rec["skipped"] = True
        if loss_scale != 1.0:
            rec["loss_scale"] = loss_scale
        if args.torch_compile:  # dynamo's compile time so far (the first steps compile the blocks): log and run_info
            rec["compile_s"] = self.recorder.run_extra["torch_compile"]["compile_s"] = compile_seconds()
        if self.comm is not None:  # this rank's bytes for the step (rank 0's record is written)
            rec.update(self.comm.record())
        return rec

    def train(self) -> dict:
        """The run, top-down: resume -> steps (eval, checkpoints on their cadence) -> final eval, checkpoint and
        export -> run_info / report. The Checkpointer and the RunRecorder are called, never call back."""
        args, acc = self.args, self.acc
        if acc.is_main_process:
            Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        acc.wait_for_everyone()
        # before resume loads a checkpoint: the model is still the initial one (e.g. a precomputed reference)
        self.objective.prepare(self.backend, self._train_batches, self._eval_batches)
        self.start_step = self.checkpointer.resume()
        self.checkpointer.watch_signals(args.preempt_signals)  # SIGTERM / SIGUSR1: checkpoint at the next step, exit
        self.recorder.start(self.start_step)
        with attention_kernels(acc.device):
            last = self._loop()
            final = self.evaluate() if args.eval_steps != 0 else {}
        self.recorder.eval(self.total_steps, final)
        if self.checkpointer.should_save(self.total_steps):
            self.checkpointer.save(self.total_steps)
        if args.save_final_model:
            self.checkpointer.export_final()
        self.recorder.finish()
        return {**last, **final}

    def _loop(self) -> dict:
        """The optimizer steps, with their evals and checkpoints; the last step's record."""
        args = self.args
        last = {}
        self.model.train()
        # the next steps' batches loaded in a thread while this one runs, where they come from the data alone (not
        # GRPO's rollouts of the weights this step updates); what was loaded ahead and not trained on is dropped
        ahead = args.dataloader_prefetch_factor if self.objective.samples_from_data else 0
        loader = StepLoader(self._load_step, self.sampler.iterate(self.start_step, self.total_steps), ahead)
        steps = iter(loader)
        try:
            while True:
                # a step's wall time includes waiting for its batches (all of their loading when nothing is ahead)
                t0, c0 = time.perf_counter(), time.process_time()
                if (item := next(steps, None)) is None:
                    break
                step, _, loaded = item
                last = self._train_step(step, loaded, t0, c0)
                self.recorder.step(last)
                done = last["step"]
                if done == self.total_steps:  # the last step's eval and checkpoint come after the loop
                    continue
                if args.eval_steps and done % args.eval_steps == 0:
                    self.recorder.eval(done, self.evaluate())
                saved = self.checkpointer.should_save(done)
                if saved:
                    self.checkpointer.save(done)
                if self.checkpointer.preempted():
                    self.recorder.end_loop()
                    self.checkpointer.stop_for_preemption(done, saved)
        finally:
            loader.close()
        self.recorder.end_loop()
        return last
