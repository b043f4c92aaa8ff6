"""The one training loop behind every recipe, on top of Accelerate.

    trainer = Trainer(args, accelerator, dims, model, tokenizer, train_ds, eval_ds, collator, task="lm")
    trainer.train()

Loss normalization (the parity contract): the optimized and logged loss of an optimizer step is
    sum of per-token losses over the whole global batch / number of real target tokens in it
(all dp ranks, all accumulation steps). Each rank back-propagates local_sum * (dp * accum) / N_global:
Accelerate divides by `accum` and the data-parallel backends average over dp, which leaves exactly
d(global_sum / N_global). Unequal sequence lengths or masks therefore do not bias the loss, unlike
a mean of per-micro-batch means.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate.utils import DistributedType
from tqdm.auto import tqdm
from hfpar.schedules import get_scheduler

from hfpar import checkpoint as ckpt
from hfpar import metrics as M
from hfpar.config import ConfigError
from hfpar.distributed import all_reduce_sum, restart_attempt, strategy_name
from hfpar.sampler import GlobalBatchSampler, eval_shard

IGNORE = -100


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """Losses are computed in at least fp32 (bf16 logits lose too much in log-softmax)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy summed over real targets. logits (B, T, V), labels (B, T) unshifted."""
    logits = _upcast(logits[:, :-1, :])  # (B, T-1, V)
    target = labels[:, 1:]  # (B, T-1)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), ignore_index=IGNORE, reduction="sum")
    return loss, (target != IGNORE).sum()


def tp_lm_loss_sum(logits_shard: torch.Tensor, labels: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """As lm_loss_sum, from vocab-parallel logit shards (B, T, V/tp): the full vocab is never gathered."""
    from hfpar.parallel.tensor import vocab_parallel_cross_entropy

    target = labels[:, 1:]
    loss = vocab_parallel_cross_entropy(logits_shard[:, :-1, :], target, group=group, ignore_index=IGNORE, reduction="sum")
    return loss, (target != IGNORE).sum()


def classify_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, C), labels (B,) with IGNORE for padding slots."""
    loss = F.cross_entropy(_upcast(logits), labels, ignore_index=IGNORE, reduction="sum")
    return loss, (labels != IGNORE).sum()


def count_targets(batch: dict, task: str) -> int:
    labels = batch["labels"]
    return int((labels[:, 1:] != IGNORE).sum()) if task == "lm" else int((labels != IGNORE).sum())


def count_input_tokens(batch: dict) -> int:
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return int(batch["input_ids"].numel())


def build_optimizer(model: torch.nn.Module | list, args, skip: frozenset = frozenset()) -> torch.optim.Optimizer:
    """AdamW; no weight decay on biases and norm weights (HF Trainer's rule: 1-D parameters). `model` may be a
    list of parameters; parameters whose id() is in `skip` are left out."""
    decay, no_decay = [], []
    for p in (model.parameters() if isinstance(model, torch.nn.Module) else model):
        if p.requires_grad and id(p) not in skip:
            ndim = len(p.ds_shape) if hasattr(p, "ds_shape") else p.dim()  # ZeRO-3 init leaves empty placeholders
            (decay if ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]  # DeepSpeed drops empty groups, which would desync the scheduler
    return torch.optim.AdamW(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                             eps=args.adam_epsilon, foreach=False)


class NonFiniteError(RuntimeError):
    pass


class Trainer:
    def __init__(self, args, accelerator, dims, model, tokenizer, train_dataset, eval_dataset, collator,
                 task: str = "lm", run_extra: dict | None = None, groups: tuple = (None, None)):
        assert task in ("lm", "classify")
        self.args, self.acc, self.dims = args, accelerator, dims
        self.tokenizer, self.collator, self.task = tokenizer, collator, task
        self.train_ds, self.eval_ds = train_dataset, eval_dataset
        self.loss_fn = lm_loss_sum if task == "lm" else classify_loss_sum
        self.tp_group, self.dp_group = groups
        self.tp = getattr(model, "_hfpar_tp", None)
        if self.tp is not None and self.tp["size"] == 1:
            self.tp = None
        if self.tp is not None and self.tp.get("vocab_parallel_logits"):
            self.loss_fn = lambda logits, labels: tp_lm_loss_sum(logits, labels, self.tp_group)
        self.ep = getattr(model, "_hfpar_ep", None)
        self.upcycled = bool(getattr(args, "upcycle_experts", 0))
        if self.ep is not None:
            from hfpar.parallel.moe_apply import attach_moe_token_mask
            from hfpar.parallel.router import set_aux_loss_grad_scale

            # the injected aux-loss gradient skips Accelerate's 1/accum and is averaged over dp by the
            # backend like every replicated grad: scale so the objective is main + coef * mean_m(aux_m)
            set_aux_loss_grad_scale(dims.dp / args.gradient_accumulation_steps)
            attach_moe_token_mask(model)  # padding takes no part in routing statistics
        self.ep_split = self.ep is not None and self.ep["size"] > 1
        self.strategy = strategy_name(accelerator)
        self.zero = self.strategy.startswith("zero")
        # model-parallel runs: hfpar wraps (DDP / FSDP2 over the dp group), not Accelerate; TP x ZeRO goes
        # through Accelerate's DeepSpeed path with an mpu that names the dp and TP groups
        # EP x ZeRO-1/2: DeepSpeed owns the dense params; hfpar owns the experts (self._setup_zero_experts)
        self.ep_zero = self.ep_split and self.zero
        self.custom = (self.tp is not None and not self.zero) or (self.ep_split and not self.zero)
        self.run_extra = run_extra or {}
        self.out = Path(args.output_dir)

        self.sampler = GlobalBatchSampler(len(train_dataset), args.per_device_train_batch_size, dims.dp,
                                          dims.dp_rank, args.gradient_accumulation_steps, args.seed)
        if args.max_steps > 0:
            self.total_steps = args.max_steps
        else:
            self.total_steps = max(1, math.ceil(args.num_train_epochs * self.sampler.steps_per_epoch))
        warmup = args.warmup_steps or math.ceil(args.warmup_ratio * self.total_steps)

        if args.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        self.n_params = M.param_count(model)
        M.track_grad_bytes()  # grads are freed after each step: record their bytes as the optimizer steps
        self.comm = None
        if args.log_comm_bytes:  # installed before the backend: DeepSpeed keeps references to the functions
            from hfpar.comm_stats import CommCounter
            from hfpar.parallel.moe import MoELayer

            self.comm = CommCounter().install()
            # expert-parallel MoE layers count the token copies they route to / receive from other ranks
            self.comm_moe = [m for m in model.modules() if isinstance(m, MoELayer) and m.ep_size > 1]
        if self.custom:  # wrap first: FSDP2 replaces the parameters the optimizer must hold
            model = self._wrap_model_parallel(model)
        experts = [p for p in model.parameters() if getattr(p, "_hfpar_ep", None) is not None] if self.ep_zero else []
        optimizer = build_optimizer(model, args, skip=frozenset(id(p) for p in experts))
        # The scheduler is stepped by us once per optimizer step (not prepared: Accelerate's wrapper
        # would step it num_processes times per call) and saved with the checkpoint.
        self.scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=warmup,
                                       num_training_steps=self.total_steps)
        if self.tp is not None and self.zero:
            from hfpar.distributed import DeepSpeedMPU, deepspeed_with_mpu
            from hfpar.parallel.apply import sequence_parallel_grad_hooks

            if self.tp["needs_grad_sync"]:  # ZeRO takes the grads in backward: reduce SP / q-k-norm grads there
                sequence_parallel_grad_hooks(model)
            with deepspeed_with_mpu(DeepSpeedMPU(self.tp_group, self.dp_group)):
                self.model, self.optimizer = accelerator.prepare(model, optimizer)
        elif self.ep_zero:
            saved = [p.detach().clone() for p in experts]
            self.model, self.optimizer = accelerator.prepare(model, optimizer)
            self._setup_zero_experts(experts, saved, warmup)
        elif not self.custom:
            self.model, self.optimizer = accelerator.prepare(model, optimizer)
        else:
            self.model, self.optimizer = model, optimizer
        if self.comm is not None and isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            self.comm.watch_ddp(self.model)
        accelerator.register_for_checkpointing(self.scheduler)
        self.start_step = 0

    def _wrap_model_parallel(self, model):
        """TP models: data parallelism over the dp group only (Accelerate's wrappers would reduce over
        the whole world, averaging different TP shards together): DDP, or FSDP2 on a dp mesh.
        Shards differ per TP rank, so hfpar checkpoints model + optimizer per rank (_save_rank_state)."""
        model.to(self.acc.device)
        # expert grads are reduced by hfpar over the ranks holding the same experts, not by the backend
        experts = [(n, p) for n, p in model.named_parameters() if getattr(p, "_hfpar_ep", None) is not None]
        if self.strategy == "fsdp2":
            from hfpar.parallel.fsdp_tp import fully_shard_dp

            return fully_shard_dp(model, self.dp_group, ignored_params={p for _, p in experts} or None)
        if self.dims.dp > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            if experts:
                DDP._set_params_and_buffers_to_ignore_for_model(model, [n for n, _ in experts])
            dev = [self.acc.device.index] if self.acc.device.type == "cuda" else None
            return DDP(model, process_group=self.dp_group, device_ids=dev)
        return model

    def _reduce_expert_grads(self, ep_params: list) -> torch.Tensor:
        """EP: an expert's grad on its rank already sums its EP group's tokens; SUM over the ranks holding
        the same experts and divide by dp gives the data-parallel mean. Returns the experts' squared norm
        summed over the EP group (float64, shape (1,))."""
        edp = self.ep["edp_group"]
        ep_sq = torch.zeros(1, dtype=torch.float64, device=self.acc.device)
        for p in ep_params:
            if edp is not None and torch.distributed.get_world_size(edp) > 1:
                torch.distributed.all_reduce(p.grad, group=edp)
            p.grad.div_(self.dims.dp)
            ep_sq += p.grad.double().square().sum()
        torch.distributed.all_reduce(ep_sq, group=self.ep["group"])
        return ep_sq

    def _reduce_expert_grads_and_clip(self, max_norm: float) -> float:
        """EP under DDP / FSDP2: expert grads reduced as above; norm over experts (across the EP group) and
        replicated params (once)."""
        ep_params = [p for p in self.model.parameters() if getattr(p, "_hfpar_ep", None) is not None and p.grad is not None]
        rep_params = [p for p in self.model.parameters() if getattr(p, "_hfpar_ep", None) is None and p.grad is not None]
        from hfpar.parallel.fsdp_tp import local_tensor, scale_grads_to_norm_

        ep_sq = self._reduce_expert_grads(ep_params)
        rep_sq = torch.zeros(1, dtype=torch.float64, device=self.acc.device)
        for p in rep_params:
            rep_sq += local_tensor(p.grad).double().square().sum()
        if self.strategy == "fsdp2":  # replicated params are FSDP shards over dp: sum their squares too
            torch.distributed.all_reduce(rep_sq, group=self.dp_group)
        total_t = (ep_sq + rep_sq).sqrt()[0]
        scale_grads_to_norm_(ep_params + rep_params, total_t, max_norm)
        return float(total_t)

    def _setup_zero_experts(self, experts: list, saved: list, warmup: int) -> None:
        """EP x ZeRO-1/2. Why by hand: DeepSpeed's own MoE support is tied to its `deepspeed.moe.layer.MoE`
        module (it finds MoE layers by type, renames expert keys in its checkpoints and averages expert
        grad norms per EP rank, which is not the one-process norm). So ZeRO partitions the dense params
        only; hfpar keeps the experts (different on every EP rank) out of DeepSpeed's optimizer:
          - DeepSpeed broadcasts every module parameter from rank 0 at initialize: the experts are put back;
          - their grads are reduced over the expert-data-parallel group and their squared norm joins
            DeepSpeed's dense norm inside its step (a wrapper on the ZeRO optimizer's `scaled_global_norm`),
            so DeepSpeed clips the dense grads, and hfpar the experts, by the one global norm;
          - an AdamW of their own (fp32 master copies when DeepSpeed cast the model to bf16), stepped and
            scheduled with DeepSpeed's, saved per rank in the checkpoint.
        """
        with torch.no_grad():
            for p, s in zip(experts, saved):
                p.copy_(s)
        self.expert_params = experts
        self.expert_masters = [p if p.dtype == torch.float32 else
                               torch.nn.Parameter(s.to(p.device, torch.float32)) for p, s in zip(experts, saved)]
        self.expert_optimizer = build_optimizer(self.expert_masters, self.args)
        self.expert_scheduler = get_scheduler(self.args.lr_scheduler_type, self.expert_optimizer,
                                              num_warmup_steps=warmup, num_training_steps=self.total_steps)
        zopt = self.model.optimizer  # DeepSpeedZeroOptimizer (stage 1 or 2)
        dense_norm = zopt.scaled_global_norm
        if not getattr(zopt, "compute_grad_norm", True):
            raise ConfigError("--ep_size with ZeRO needs DeepSpeed to compute the grad norm (compute_grad_norm)")

        def norm_with_experts(*a, **kw):
            dense = torch.as_tensor(dense_norm(*a, **kw), device=self.acc.device)
            ep_sq = self._reduce_expert_grads([p for p in self.expert_params if p.grad is not None])
            self._zero_total_norm = (dense.double().square() + ep_sq[0]).sqrt()
            return self._zero_total_norm.to(dense.dtype)

        zopt.scaled_global_norm = norm_with_experts

    def _step_zero_experts(self, max_norm: float) -> None:
        """After DeepSpeed's step (inside backward): clip the experts by the global norm, step them."""
        from hfpar.parallel.fsdp_tp import scale_grads_to_norm_

        live = [(p, m) for p, m in zip(self.expert_params, self.expert_masters) if p.grad is not None]
        for p, m in live:
            if m is not p:
                m.grad = p.grad.float()
        scale_grads_to_norm_([m for _, m in live], self._zero_total_norm, max_norm)
        self.expert_optimizer.step()
        with torch.no_grad():
            for p, m in live:
                if m is not p:
                    p.copy_(m)

    def _unwrapped(self):
        return self.model.module if hasattr(self.model, "module") else self.model

    def _rank_state_file(self, ckpt_dir) -> Path:
        if self.strategy == "fsdp2" or self.ep_split:  # per-rank shards (dp x tp, or experts)
            return Path(ckpt_dir) / f"rank{self.dims.rank:03d}_of{self.dims.world:03d}.pt"
        return Path(ckpt_dir) / f"tp_rank{self.dims.tp_rank:02d}_of{self.dims.tp:02d}.pt"

    def _save_rank_state(self, ckpt_dir) -> None:
        if self.ep_zero:  # DeepSpeed's checkpoint holds rank 0's experts only
            torch.save({"experts": [p.detach() for p in self.expert_params],
                        "masters": [m.detach() for m in self.expert_masters],
                        "optimizer": self.expert_optimizer.state_dict(),
                        "scheduler": self.expert_scheduler.state_dict()}, self._rank_state_file(ckpt_dir))
            return
        if not self.custom:
            return
        if self.strategy == "fsdp2":
            from hfpar.parallel.fsdp_tp import local_state

            torch.save({"model": local_state(self.model.state_dict()),
                        "optimizer": local_state(self.optimizer.state_dict())}, self._rank_state_file(ckpt_dir))
        elif self.ep_split or self.dims.dp_rank == 0:  # experts differ per rank; TP x DDP replicas are identical
            torch.save({"model": self._unwrapped().state_dict(), "optimizer": self.optimizer.state_dict()},
                       self._rank_state_file(ckpt_dir))

    def _load_rank_state(self, ckpt_dir) -> None:
        if not (self.custom or self.ep_zero):
            return
        f = self._rank_state_file(ckpt_dir)
        if not f.is_file():
            raise ConfigError(f"checkpoint {ckpt_dir} has no {f.name}: it was written with another world size / --tp_size")
        state = torch.load(f, map_location=self.acc.device, weights_only=False)
        if self.ep_zero:  # after DeepSpeed's load, which put rank 0's experts everywhere
            with torch.no_grad():
                for p, t in zip(self.expert_params, state["experts"]):
                    p.copy_(t)
                for m, t in zip(self.expert_masters, state["masters"]):
                    m.copy_(t)
            self.expert_optimizer.load_state_dict(state["optimizer"])
            self.expert_scheduler.load_state_dict(state["scheduler"])
            return
        if self.strategy == "fsdp2":
            from hfpar.parallel.fsdp_tp import load_local_state, load_optimizer_2d

            with torch.no_grad():
                load_local_state(self.model.state_dict(), state["model"])
            load_optimizer_2d(self.optimizer, state["optimizer"])
        else:
            self._unwrapped().load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])

    # ------------------------------------------------------------------ helpers
    def _to_device(self, batch: dict) -> dict:
        return {k: v.to(self.acc.device, non_blocking=True) for k, v in batch.items()}

    def _collate(self, indices: list[int]) -> dict:
        return self.collator([self.train_ds[i] for i in indices])

    def _forward_loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        labels = batch["labels"]
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        extra = {"use_cache": False} if self.task == "lm" else {}
        with self.acc.autocast() if self.custom else contextlib.nullcontext():  # prepare() adds it otherwise
            logits = self.model(**inputs, **extra).logits
        loss_sum, n = self.loss_fn(logits, labels)
        return loss_sum, n, logits

    def _grad_norm_and_clip(self) -> float:
        max_norm = self.args.max_grad_norm if self.args.max_grad_norm > 0 else float("inf")
        if self.ep_zero:  # DeepSpeed has stepped (inside backward) with the global norm: now the experts
            self._step_zero_experts(max_norm)
            return float(self._zero_total_norm)
        if self.ep_split:
            return self._reduce_expert_grads_and_clip(max_norm)
        if self.custom and self.tp is not None and self.strategy == "fsdp2":
            from hfpar.parallel.fsdp_tp import clip_grad_norm_2d_, sync_sp_grads_2d

            sync_sp_grads_2d(self.model, self.tp_group)
            return float(clip_grad_norm_2d_(self.model, max_norm, self.tp_group, self.dp_group))
        if self.custom and self.tp is not None:
            from hfpar.parallel.apply import clip_tp_grad_norm_, sync_sequence_parallel_grads

            sync_sequence_parallel_grads(self._unwrapped())
            return float(clip_tp_grad_norm_(self.model.parameters(), max_norm, self.tp_group))
        norm = self.acc.clip_grad_norm_(self.model.parameters(), max_norm)
        if norm is None:
            return float("nan")
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    # ------------------------------------------------------------------ state
    def _trainer_state(self, step: int) -> dict:
        return {"global_step": step, "world_size": self.dims.world, "dp": self.dims.dp, "tp": self.dims.tp,
                "ep": self.dims.ep, "strategy": self.strategy, "seed": self.args.seed,
                "global_batch": self.sampler.global_batch}

    def maybe_resume(self) -> None:
        path = ckpt.resolve_resume(self.args.resume_from_checkpoint, self.args.output_dir)
        if path is None:
            if self.args.resume_from_checkpoint:
                self.acc.print(f"[hfpar] --resume_from_checkpoint {self.args.resume_from_checkpoint}: no checkpoint yet, starting fresh")
            return
        state = ckpt.read_trainer_state(path)  # checked before anything is loaded
        if (state.get("tp", 1), state.get("ep", 1)) != (self.dims.tp, self.dims.ep):
            raise ConfigError(f"checkpoint {path} was written with tp {state.get('tp', 1)} / ep {state.get('ep', 1)}; "
                              f"this run has tp {self.dims.tp} / ep {self.dims.ep}: resume with the same --tp_size/--ep_size")
        if state["global_batch"] != self.sampler.global_batch:
            raise ConfigError(
                f"checkpoint {path} was trained with global batch {state['global_batch']}, this run has "
                f"{self.sampler.global_batch}; keep per_device_train_batch_size x dp x gradient_accumulation_steps equal to resume")
        if state["world_size"] != self.dims.world and (self.zero or self.custom):
            # DDP states are full and FSDP2's are DCP (resharded on load); ZeRO partitions and hfpar's per-rank
            # TP / EP files are tied to the world size that wrote them
            how = ("relaunch with the same --num_processes" if self.custom else
                   f"to go on with {self.dims.world}, export it (hfpar export {path} OUT) and start from "
                   "--model_name_or_path OUT (optimizer state restarts)")
            raise ConfigError(
                f"checkpoint {path} was written by {state['world_size']} processes, this run has {self.dims.world}: "
                f"{self.strategy}{' with TP/EP' if self.custom else ''} checkpoints resume on the same world size only; {how}")
        ckpt.load_checkpoint(self.acc, path)
        self._load_rank_state(path)
        self.start_step = state["global_step"]
        attempt = restart_attempt()
        self.acc.print(f"[hfpar] resumed from {path} at step {self.start_step}"
                       + (f" (torchrun restart attempt {attempt})" if attempt else ""))

    def write_run_info(self, **final) -> None:
        """Collective. After the first step (optimizer state exists) and again at the end (peak memory, wall time)."""
        opt_bytes = M.optimizer_state_bytes(self.optimizer)
        if self.ep_zero:  # the experts' AdamW (and fp32 masters when the model is bf16)
            opt_bytes += M.optimizer_state_bytes(self.expert_optimizer) + sum(
                m.numel() * m.element_size() for p, m in zip(self.expert_params, self.expert_masters) if m is not p)
        local = torch.tensor([M.param_bytes(self.model), opt_bytes,
                              M.grad_bytes(self.optimizer), M.peak_memory_bytes(self.acc.device)], dtype=torch.float64)
        gathered = self.acc.gather(local.to(self.acc.device)).view(-1, 4).cpu()
        info = {
            "strategy": self.strategy,
            "distributed_type": str(self.acc.distributed_type).split(".")[-1],
            "mixed_precision": self.acc.mixed_precision,
            "device": str(self.acc.device),
            "world_size": self.dims.world, "dp_size": self.dims.dp, "tp_size": self.dims.tp, "ep_size": self.dims.ep,
            "num_parameters": self.n_params,
            "param_bytes_per_rank": [int(x) for x in gathered[:, 0]],
            "optimizer_state_bytes_per_rank": [int(x) for x in gathered[:, 1]],
            "grad_bytes_per_rank": [int(x) for x in gathered[:, 2]],
            "peak_mem_bytes_per_rank": [int(x) for x in gathered[:, 3]],
            "global_batch_size": self.sampler.global_batch,
            "total_steps": self.total_steps,
            "versions": M.library_versions(),
            "command": M.command_line(),
            **self.run_extra,
            **final,
        }
        if self.acc.is_main_process:
            M.write_json(self.out / "run_info.json", info)

    # ------------------------------------------------------------------ eval
    @torch.no_grad()
    def evaluate(self) -> dict:
        if self.eval_ds is None or len(self.eval_ds) == 0:
            return {}
        self.model.eval()
        n = len(self.eval_ds)
        if self.args.max_eval_samples:
            n = min(n, self.args.max_eval_samples)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.acc.device)
        count = torch.zeros((), dtype=torch.float64, device=self.acc.device)
        correct = torch.zeros((), dtype=torch.float64, device=self.acc.device)
        for idx in eval_shard(n, self.args.per_device_eval_batch_size, self.dims.dp, self.dims.dp_rank):
            feats = []
            for i in idx:
                f = dict(self.eval_ds[i if i is not None else 0])
                if i is None:  # padding slot: same shapes, no targets
                    lab = f["labels"]
                    f["labels"] = [IGNORE] * len(lab) if isinstance(lab, list) else IGNORE
                feats.append(f)
            batch = self._to_device(self.collator(feats))
            ls, cnt, logits = self._forward_loss(batch)
            loss_sum += ls.double()
            count += cnt.double()
            if self.task == "classify":
                lab = batch["labels"]
                correct += ((logits.argmax(-1) == lab) & (lab != IGNORE)).sum().double()
        stats = torch.stack([loss_sum, count, correct])
        if self.acc.num_processes > 1:
            torch.distributed.all_reduce(stats)
        # every rank of a tp group counted the same samples
        stats = stats / self.dims.tp
        self.model.train()
        out = {"eval_loss": float(stats[0] / stats[1].clamp(min=1))}
        if self.task == "classify":
            out["eval_accuracy"] = float(stats[2] / stats[1].clamp(min=1))
        return out

    # ------------------------------------------------------------------ train
    def train(self) -> dict:
        args, acc = self.args, self.acc
        if acc.is_main_process:
            self.out.mkdir(parents=True, exist_ok=True)
        acc.wait_for_everyone()
        self.maybe_resume()
        t_start = time.perf_counter()
        writer = M.MetricsWriter(self.out / "metrics.jsonl", acc.is_main_process, append=self.start_step > 0)
        if self.start_step > 0 and acc.is_main_process:
            _truncate_metrics(self.out / "metrics.jsonl", self.start_step)
        dp_accum = self.dims.dp * args.gradient_accumulation_steps
        eval_every = args.eval_steps
        bar = tqdm(total=self.total_steps, initial=self.start_step, disable=not acc.is_local_main_process,
                   desc=f"hfpar {self.strategy}", dynamic_ncols=True)
        last = {}
        self.model.train()
        for step, epoch, micro in self.sampler.iterate(self.start_step, self.total_steps):
            t0 = time.perf_counter()
            if self.comm is not None:
                self.comm.reset()
                for m in self.comm_moe:
                    m.routed_remote_rows = m.received_remote_rows = 0
            batches = [self._collate(ix) for ix in micro]
            local_targets = sum(count_targets(b, self.task) for b in batches)
            local_tokens = sum(count_input_tokens(b) for b in batches)
            totals = all_reduce_sum(torch.tensor([local_targets, local_tokens]), acc.device) / self.dims.tp
            n_global = float(totals[0])
            if n_global == 0:
                raise ValueError(f"step {step + 1}: the global batch has no target tokens (all labels masked); check the data / --completion_only_loss")
            step_loss = torch.zeros((), dtype=torch.float64, device=acc.device)
            for batch in batches:
                batch = self._to_device(batch)
                with acc.accumulate(self.model):
                    loss_sum, _, _ = self._forward_loss(batch)
                    acc.backward(loss_sum * (dp_accum / n_global))
                step_loss += loss_sum.detach().double()
            loss = float(all_reduce_sum(step_loss, acc.device) / self.dims.tp) / n_global
            grad_norm = self._grad_norm_and_clip()
            bad = not math.isfinite(loss) or (acc.distributed_type != DistributedType.DEEPSPEED and not math.isfinite(grad_norm))
            if bad and args.on_nonfinite == "error":
                raise NonFiniteError(f"step {step + 1}: non-finite loss {loss} or grad_norm {grad_norm}; stopping before the optimizer step")
            if not bad:
                self.optimizer.step()
            lr = self.scheduler.get_last_lr()[0]
            with warnings.catch_warnings():  # DeepSpeed steps its optimizer inside backward; the order is right
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()`")
                self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            if self.ep_zero:
                self.expert_scheduler.step()
                self.expert_optimizer.zero_grad(set_to_none=True)
                for p in self.expert_params:
                    p.grad = None
            dt = time.perf_counter() - t0
            done = step + 1
            rec = {"step": done, "epoch": round(step / self.sampler.steps_per_epoch, 4), "loss": loss, "lr": lr,
                   "grad_norm": grad_norm, "tokens_per_s": float(totals[1]) / dt, "step_time_s": dt,
                   "num_target_tokens": int(n_global), "peak_mem_bytes": M.peak_memory_bytes(acc.device)}
            if bad:
                rec["skipped"] = True
            if self.comm is not None:  # this rank's bytes for the step (rank 0's record is written)
                rec["comm"] = self.comm.snapshot()
                rec["comm_wire_bytes"] = self.comm.wire_total()
                if self.comm_moe:  # summed over this rank's MoE layers (forward calls of the step)
                    rec["moe_routed_remote_rows"] = sum(m.routed_remote_rows for m in self.comm_moe)
                    rec["moe_received_remote_rows"] = sum(m.received_remote_rows for m in self.comm_moe)
            writer.write(rec)
            if step == self.start_step:  # after the first step, so optimizer state exists and is counted
                self.write_run_info()
            last = rec
            if args.report_to != "none":
                acc.log({k: v for k, v in rec.items() if k != "step"}, step=done)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")
            if done % args.logging_steps == 0 or done == self.total_steps:
                if acc.is_local_main_process:
                    bar.write(f"step {done}/{self.total_steps} loss {loss:.4f} grad_norm {grad_norm:.3f} "
                              f"lr {lr:.3e} tok/s {rec['tokens_per_s']:.0f}")
            if eval_every and done % eval_every == 0 and done != self.total_steps:
                self._log_eval(writer, done)
            if args.save_steps and done % args.save_steps == 0 and done != self.total_steps:
                ckpt.save_checkpoint(acc, args.output_dir, done, self._trainer_state(done), args.save_total_limit,
                                     extra=self._save_rank_state, tokenizer=self.tokenizer)
        bar.close()
        final = {}
        if eval_every != 0:
            final = self._log_eval(writer, self.total_steps)
        if args.save_steps:
            ckpt.save_checkpoint(acc, args.output_dir, self.total_steps, self._trainer_state(self.total_steps),
                                 args.save_total_limit, extra=self._save_rank_state, tokenizer=self.tokenizer)
        if args.save_final_model:
            self._export()
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
        from hfpar import plot

        try:
            path = plot.write_report(self.out)
            print(f"[hfpar] report: {path}")
        except plot.PlotError as exc:  # matplotlib absent: the run itself is fine
            print(f"[hfpar] no report.png: {exc}")
        print(plot.summary_table(self.out))

    def _export(self) -> None:
        """The final model in HF format at output_dir's root, whatever the strategy (shards gathered)."""
        acc, args = self.acc, self.args
        if getattr(args, "use_peft", False):  # LoRA: the adapter, or with --merge_adapter the merged model
            from hfpar.lora import export_lora

            export_lora(acc, self.model, self.tokenizer, args.output_dir, merge=args.merge_adapter)
            return
        if self.ep is not None and (self.ep_split or self.upcycled):
            from hfpar.parallel.moe_apply import gather_expert_state_dict, save_upcycled_pretrained

            full = None
            if self.ep_split:
                if self.strategy == "fsdp2":  # non-expert params are DTensors over dp: full tensors first
                    from hfpar.parallel.fsdp_tp import full_state_dict_2d

                    full = gather_expert_state_dict(self._unwrapped(), full_state_dict_2d(self._unwrapped()))
                else:
                    full = gather_expert_state_dict(self._unwrapped())
            if full is None:
                full = acc.get_state_dict(self.model)
            if self.upcycled:  # saved as the matching HF MoE architecture (e.g. Mixtral for Llama)
                save_upcycled_pretrained(self._unwrapped(), args.output_dir, state_dict=full,
                                         is_main_process=acc.is_main_process)
                if acc.is_main_process and self.tokenizer is not None:
                    self.tokenizer.save_pretrained(args.output_dir)
                acc.wait_for_everyone()
            else:
                ckpt.export_model(acc, self.model, self.tokenizer, args.output_dir, state_dict=full)
        elif self.tp is not None:
            if self.strategy == "fsdp2":
                from hfpar.parallel.fsdp_tp import full_state_dict_2d as gather_full_state_dict
            else:
                from hfpar.parallel.apply import gather_full_state_dict

            full = gather_full_state_dict(self._unwrapped())  # collective: full tensors, HF names
            ckpt.export_model(acc, self.model, self.tokenizer, args.output_dir, state_dict=full)
        else:
            ckpt.export_model(acc, self.model, self.tokenizer, args.output_dir)

    def _log_eval(self, writer, step: int) -> dict:
        ev = self.evaluate()
        if ev:
            writer.write({"step": step, **ev})
            if self.args.report_to != "none":
                self.acc.log(ev, step=step)
            msg = " ".join(f"{k} {v:.4f}" for k, v in ev.items())
            self.acc.print(f"[hfpar] step {step}: {msg}")
        return ev


def _truncate_metrics(path: Path, step: int) -> None:
    """On resume, drop records the interrupted run wrote after the checkpoint step."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in keep))
