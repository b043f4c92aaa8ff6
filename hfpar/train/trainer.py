"""The one training loop behind every recipe and every composition (the backend holds what differs).

    trainer = Trainer(args, accelerator, ctx, backend, model, tokenizer, train_ds, eval_ds, collator, task="lm")
    trainer.train()

Loss normalization (the parity contract): the optimized and logged loss of an optimizer step is
    sum of per-token losses over the whole global batch / number of real target tokens in it
(all dp ranks, all accumulation steps). Each rank back-propagates local_sum * (dp * accum) / N_global:
Accelerate divides by `accum` and the data-parallel backends average over dp, which leaves exactly
d(global_sum / N_global). Unequal sequence lengths or masks therefore do not bias the loss, unlike
a mean of per-micro-batch means.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hfpar.checkpoint import checkpointer as ckpt
from hfpar.observe import metrics as M
from hfpar.observe import plot
from hfpar.observe.comm_stats import StepCommLog
from hfpar.distributed import all_reduce_sum, restart_attempt
from hfpar.train.batch_plan import BatchPlan
from hfpar.train.losses import IGNORE, count_targets, lm_loss_sum, make_loss_fn  # noqa: F401
from hfpar.parallel.pipeline import pipeline_stages
from hfpar.train.sampler import GlobalBatchSampler, eval_shard
from hfpar.train.schedules import get_scheduler


class NonFiniteError(RuntimeError):
    pass


class Trainer:
    def __init__(self, args, accelerator, ctx, backend, model, tokenizer, train_dataset, eval_dataset, collator,
                 task: str = "lm", run_extra: dict | None = None):
        assert task in ("lm", "classify")
        self.args, self.acc, self.ctx, self.backend = args, accelerator, ctx, backend
        self.tokenizer, self.collator, self.task = tokenizer, collator, task
        self.train_ds, self.eval_ds = train_dataset, eval_dataset
        self.run_extra = run_extra or {}
        self.out = Path(args.output_dir)
        self.loss_fn = make_loss_fn(task, model)
        self.batch_plan = BatchPlan(task, ctx, ctx.cp_mode)
        self.sampler = GlobalBatchSampler(len(train_dataset), args.per_device_train_batch_size, ctx.dp,
                                          ctx.dp_rank, args.gradient_accumulation_steps, args.seed)
        if args.max_steps > 0:
            self.total_steps = args.max_steps
        else:
            self.total_steps = max(1, math.ceil(args.num_train_epochs * self.sampler.steps_per_epoch))
        warmup = args.warmup_steps or math.ceil(args.warmup_ratio * self.total_steps)
        self.n_params = M.param_count(model)
        M.track_grad_bytes()  # grads are freed after each step: record their bytes as the optimizer steps
        self.comm = StepCommLog(model) if args.log_comm_bytes else None  # before the backend wraps
        backend.prepare(model)  # plain FSDP2 from a checkpoint: each rank's shards are read here (hfpar.loading.sharded)
        self.model, self.optimizer = backend.model, backend.optimizer
        self.rss_after_load = M.host_peak_rss_bytes()  # the model is loaded and wrapped on every path by now
        # Stepped by us once per optimizer step (not prepared: Accelerate's wrapper would step it num_processes
        # times per call) and saved with the checkpoint.
        self.scheduler = get_scheduler(args.lr_scheduler_type, backend.base_optimizer, num_warmup_steps=warmup,
                                       num_training_steps=self.total_steps)
        if self.comm is not None:
            self.comm.watch(self.model)
        accelerator.register_for_checkpointing(self.scheduler)
        self.start_step = 0
        # versions, command, optimizer implementation: gathered here, never inside the loop (no import stalls a step)
        self.run_meta = M.run_metadata(self.optimizer)

    # ------------------------------------------------------------------ state
    def _trainer_state(self, step: int) -> dict:
        c = self.ctx
        return {"global_step": step, "world_size": c.world, "dp": c.dp, "tp": c.tp, "ep": c.ep, "cp": c.cp,
                "pp": c.pp, "pp_virtual_stages": pipeline_stages(c.pp, self.args.pp_schedule, self.args.pp_virtual_stages) // c.pp,  # chunks per pipeline rank
                "strategy": self.backend.strategy, "seed": self.args.seed,
                "global_batch": self.sampler.global_batch}

    def maybe_resume(self) -> None:
        """Compatibility was checked by the preflight, before the model was loaded; here the state is loaded."""
        path = ckpt.resolve_resume(self.args.resume_from_checkpoint, self.args.output_dir)
        if path is None:
            if self.args.resume_from_checkpoint:
                self.acc.print(f"[hfpar] --resume_from_checkpoint {self.args.resume_from_checkpoint}: no checkpoint yet, starting fresh")
            return
        state = ckpt.load_checkpoint(self.acc, path)
        self.backend.load_rank_state(path)
        self.start_step = state["global_step"]
        attempt = restart_attempt()
        self.acc.print(f"[hfpar] resumed from {path} at step {self.start_step}"
                       + (f" (torchrun restart attempt {attempt})" if attempt else ""))

    def _save(self, step: int) -> None:
        ckpt.save_checkpoint(self.acc, self.args.output_dir, step, self._trainer_state(step), self.args.save_total_limit,
                             extra=self.backend.save_rank_state, tokenizer=self.tokenizer)

    def write_run_info(self, **final) -> None:
        """Collective. After the first step (optimizer state exists) and again at the end (peak memory, wall time)."""
        opt_bytes = M.optimizer_state_bytes(self.optimizer) + self.backend.extra_state_bytes()
        local = torch.tensor([M.param_bytes(self.model), opt_bytes, M.grad_bytes(self.optimizer),
                              M.peak_memory_bytes(self.acc.device), self.rss_after_load, M.host_peak_rss_bytes()],
                             dtype=torch.float64)
        gathered = self.acc.gather(local.to(self.acc.device)).view(-1, 6).cpu()
        info = {
            "strategy": self.backend.strategy,
            "backend": self.backend.name,
            "distributed_type": str(self.acc.distributed_type).split(".")[-1],
            "mixed_precision": self.acc.mixed_precision,
            "device": str(self.acc.device),
            **self.ctx.as_dict(),
            "num_parameters": self.n_params,
            "param_bytes_per_rank": [int(x) for x in gathered[:, 0]],
            "optimizer_state_bytes_per_rank": [int(x) for x in gathered[:, 1]],
            "grad_bytes_per_rank": [int(x) for x in gathered[:, 2]],
            "peak_mem_bytes_per_rank": [int(x) for x in gathered[:, 3]],
            # host memory of each rank's process: peak RSS once the model was loaded and wrapped, and so far (the
            # final write: the whole run)
            "host_peak_rss_after_load_bytes_per_rank": [int(x) for x in gathered[:, 4]],
            "host_peak_rss_bytes_per_rank": [int(x) for x in gathered[:, 5]],
            "global_batch_size": self.sampler.global_batch,
            "total_steps": self.total_steps,
            **self.run_meta,
            **self.run_extra,
            **final,
        }
        if self.acc.is_main_process:
            M.write_json(self.out / "run_info.json", info)

    # ------------------------------------------------------------------ forward
    def _to_device(self, batch: dict) -> dict:
        return {k: v.to(self.acc.device, non_blocking=True) for k, v in batch.items()}

    # ------------------------------------------------------------------ eval
    @torch.no_grad()
    def evaluate(self) -> dict:
        if self.eval_ds is None or len(self.eval_ds) == 0:
            return {}
        self.model.eval()
        n = min(len(self.eval_ds), self.args.max_eval_samples or len(self.eval_ds))
        stats = torch.zeros(3, dtype=torch.float64, device=self.acc.device)  # loss sum, targets, correct
        for idx in eval_shard(n, self.args.per_device_eval_batch_size, self.ctx.dp, self.ctx.dp_rank):
            feats = []
            for i in idx:
                f = dict(self.eval_ds[i if i is not None else 0])
                if i is None:  # padding slot: same shapes, no targets
                    lab = f["labels"]
                    f["labels"] = [IGNORE] * len(lab) if isinstance(lab, list) else IGNORE
                feats.append(f)
            batch, scope = self.batch_plan(self._to_device(self.collator(feats)))
            ls, cnt, logits = self.backend.eval_loss(batch, scope, self.loss_fn, self.task)
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
        return out

    def _log_eval(self, writer, step: int) -> dict:
        ev = self.evaluate()
        if ev:
            writer.write({"step": step, **ev})
            if self.args.report_to != "none":
                self.acc.log(ev, step=step)
            self.acc.print(f"[hfpar] step {step}: " + " ".join(f"{k} {v:.4f}" for k, v in ev.items()))
        return ev

    # ------------------------------------------------------------------ train
    def _train_step(self, step: int, micro: list) -> dict:
        """One optimizer step over the accumulation steps' micro-batches; returns its metrics record."""
        args, acc, ctx = self.args, self.acc, self.ctx
        t0 = time.perf_counter()
        if self.comm is not None:
            self.comm.reset()
        feats = [[self.train_ds[i] for i in ix] for ix in micro]
        batches = [self.batch_plan(self._to_device(self.collator(f))) for f in feats]
        # real (non-pad) tokens, whatever the rows' layout; the cp ranks of a replica hold the same samples
        real = sum(len(x["input_ids"]) for f in feats for x in f) / ctx.cp
        totals = all_reduce_sum([sum(count_targets(b) for b, _ in batches), real], acc.device) / ctx.data_replicas
        n_global = float(totals[0])
        if n_global == 0:
            raise ValueError(f"step {step + 1}: the global batch has no target tokens (all labels masked); check the data / --completion_only_loss")
        step_loss = torch.zeros((), dtype=torch.float64, device=acc.device)
        loss_scale = self.backend.loss_scale()  # fp16: the scale this step's backwards use (DeepSpeed updates it in them)
        for batch, scope in batches:
            # the backend averages grads over dp x cp ranks: this scale leaves exactly d(global loss sum / N_global)
            step_loss += self.backend.train_micro(batch, scope, self.loss_fn, ctx.grad_replicas / n_global,
                                                  self.task).double()
        loss = float(all_reduce_sum(step_loss, acc.device) / ctx.data_replicas) / n_global
        max_norm = args.max_grad_norm if args.max_grad_norm > 0 else float("inf")
        grad_norm = self.backend.clip(max_norm)
        # fp16: overflowed grads are the loss scaler's business (it skips the step on every rank, lowers its scale)
        overflow = self.backend.overflowed(grad_norm)
        bad = not overflow and (not math.isfinite(loss) or (not self.backend.steps_in_backward and not math.isfinite(grad_norm)))
        if bad and args.on_nonfinite == "error":
            raise NonFiniteError(f"step {step + 1}: non-finite loss {loss} or grad_norm {grad_norm}; stopping before the optimizer step")
        lr = self.scheduler.get_last_lr()[0]
        if not bad:
            self.backend.step(lr)
        with warnings.catch_warnings():  # DeepSpeed steps its optimizer inside backward; the order is right
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()`")
            self.scheduler.step()
        self.backend.zero_grad()
        dt = time.perf_counter() - t0
        rec = {"step": step + 1, "epoch": round(step / self.sampler.steps_per_epoch, 4), "loss": loss, "lr": lr,
               "grad_norm": grad_norm, "tokens_per_s": float(totals[1]) / dt, "step_time_s": dt,
               "num_target_tokens": int(n_global), "peak_mem_bytes": M.peak_memory_bytes(acc.device)}
        if bad or overflow:
            rec["skipped"] = True
        if loss_scale != 1.0:
            rec["loss_scale"] = loss_scale
        if self.comm is not None:  # this rank's bytes for the step (rank 0's record is written)
            rec.update(self.comm.record())
        return rec

    def train(self) -> dict:
        args, acc = self.args, self.acc
        if acc.is_main_process:
            self.out.mkdir(parents=True, exist_ok=True)
        acc.wait_for_everyone()
        self.maybe_resume()
        t_start = time.perf_counter()
        if self.start_step > 0 and acc.is_main_process:
            _truncate_metrics(self.out / "metrics.jsonl", self.start_step)
        writer = M.MetricsWriter(self.out / "metrics.jsonl", acc.is_main_process, append=self.start_step > 0)
        bar = tqdm(total=self.total_steps, initial=self.start_step, disable=not acc.is_local_main_process,
                   desc=f"hfpar {self.backend.strategy}", dynamic_ncols=True)
        last = {}
        self.model.train()
        for step, _, micro in self.sampler.iterate(self.start_step, self.total_steps):
            rec = last = self._train_step(step, micro)
            done = rec["step"]
            writer.write(rec)
            if step == self.start_step:  # after the first step, so optimizer state exists and is counted
                self.write_run_info()
            if args.report_to != "none":
                acc.log({k: v for k, v in rec.items() if k != "step"}, step=done)
            bar.update(1)
            bar.set_postfix(loss=f"{rec['loss']:.4f}", lr=f"{rec['lr']:.2e}")
            if (done % args.logging_steps == 0 or done == self.total_steps) and acc.is_local_main_process:
                bar.write(f"step {done}/{self.total_steps} loss {rec['loss']:.4f} grad_norm {rec['grad_norm']:.3f} "
                          f"lr {rec['lr']:.3e} tok/s {rec['tokens_per_s']:.0f}")
            if args.eval_steps and done % args.eval_steps == 0 and done != self.total_steps:
                self._log_eval(writer, done)
            if args.save_steps and done % args.save_steps == 0 and done != self.total_steps:
                self._save(done)
        bar.close()
        final = self._log_eval(writer, self.total_steps) if args.eval_steps != 0 else {}
        if args.save_steps:
            self._save(self.total_steps)
        if args.save_final_model:
            ckpt.export_final(acc, self.backend, self.tokenizer, args)
        self.write_run_info(wall_time_s=round(time.perf_counter() - t_start, 2))
        if acc.is_main_process:
            self._report()
        # no rank tears its process groups down while another still uses them; before end_training, which
        # (Accelerate >= 1.x) destroys the default process group when trackers are on
        acc.wait_for_everyone()
        if args.report_to != "none":
            acc.end_training()
        return {**last, **final}

    def _report(self) -> None:
        """report.png (loss, eval loss, lr, tokens/s) and a summary table at the end of the run."""
        try:
            print(f"[hfpar] report: {plot.write_report(self.out)}")
        except plot.PlotError as exc:  # matplotlib absent: the run itself is fine
            print(f"[hfpar] no report.png: {exc}")
        print(plot.summary_table(self.out))


def _truncate_metrics(path: Path, step: int) -> None:
    """On resume, drop records the interrupted run wrote after the checkpoint step."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in keep))
