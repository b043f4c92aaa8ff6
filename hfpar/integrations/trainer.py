"""hfpar's TP / EP model inside the stock transformers.Trainer and TRL's trainers (SFTTrainer, DPOTrainer, ...).

    args = TrainingArguments(...)                        # under torchrun: creates the process group
    ctx = parallelize(model, tp_size=2, ep_size=1)       # hfpar.integrations.model
    trainer = SFTTrainer(model=model, args=args, ...)    # any Trainer subclass
    prepare_trainer(trainer)                             # this module: BEFORE trainer.train()
    trainer.train(); trainer.save_model("out")           # save_model is collective: a full HF checkpoint

What it does to THIS trainer object (nothing global is patched):
  - its Accelerator, through prepare_accelerator: DDP over the dp group only (experts left out, reduced over their
    group), rows sharded by dp rank (TP ranks read identical batches), grads finished before every optimizer step,
    clip_grad_norm_ = the one global norm;
  - save_model: the gathered full weights (every rank takes part), save_pretrained by rank 0;
  - TRL's fused LM head (SFT / DPO compute log-probs from `lm_head.weight` directly, which under TP is this rank's
    vocab rows): the head's weight is all-gathered (autograd: each rank keeps its rows' grad) for that forward, so
    log-probs, entropy and accuracy are the full vocabulary's; also for a TP reference model (DPO);
  - refused in one line: checkpoints that would hold one rank's optimizer shards (save_strategy without
    save_only_model=True) and resume_from_checkpoint (use hfpar's recipes for resumable TP / EP runs).
The token normalisation needs nothing: Trainer gathers num_items_in_batch over the world (each TP rank counts its
replica's tokens once) and scales the loss by the world size, so the DDP mean over dp gives sum / global tokens.
"""

from __future__ import annotations

import functools
import os
import types

import torch
import torch.distributed as dist

from hfpar.parallel.comm import gather_from_sequence_parallel_region
from hfpar.parallel.sharding import shard_spec

from .accelerator import prepare_accelerator
from .model import context_of, save_pretrained

__all__ = ["prepare_trainer"]


def prepare_trainer(trainer) -> None:
    """Make a transformers Trainer (or a TRL trainer) train, clip and save a model sharded by parallelize()."""
    ctx = context_of(trainer.model)
    if ctx is None:
        raise ValueError(
            "prepare_trainer: trainer.model was not sharded by hfpar.integrations.parallelize(model, "
            "tp_size=..., ep_size=...)"
        )
    args = trainer.args
    if str(args.save_strategy) not in ("no", "SaveStrategy.NO") and not args.save_only_model:
        raise ValueError(
            f"prepare_trainer: save_strategy={args.save_strategy!s} would write rank 0's optimizer shards "
            "only (a resume would be silently wrong); set save_only_model=True (checkpoints then hold "
            "the gathered model) or save_strategy='no'"
        )
    prepare_accelerator(trainer.accelerator, ctx)
    for model in (trainer.model, getattr(trainer, "ref_model", None)):
        if model is not None:
            _gather_fused_head(model)
    if hasattr(trainer, "_tp_size"):  # TRL: token-count metrics gathered over the world count TP ranks once each
        trainer._tp_size = ctx.tp
    trainer.save_model = types.MethodType(_save_model, trainer)
    train = trainer.train

    @functools.wraps(train)
    def _train(resume_from_checkpoint=None, **kwargs):
        if resume_from_checkpoint:
            raise ValueError(
                "prepare_trainer: resume_from_checkpoint is not supported with hfpar's TP / EP layers in "
                "a Trainer (its checkpoints hold one rank's optimizer state); use hfpar's recipes"
            )
        return train(**kwargs)

    trainer.train = _train


def _save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
    """Trainer.save_model, collective: full weights gathered on every rank, written by rank 0."""
    output_dir = output_dir or self.args.output_dir
    os.makedirs(output_dir, exist_ok=True)
    save_pretrained(self.model, output_dir, tokenizer=self.processing_class)
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))


def _gather_fused_head(model: torch.nn.Module) -> None:
    """Around TRL's fused forward (an instance `forward` that reads `get_output_embeddings().weight`), hand it the
    vocab-parallel head's FULL weight: all-gathered rows, whose backward keeps this rank's rows (every TP rank runs
    the same replicated computation on the same tokens)."""
    fused = model.__dict__.get("forward")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    spec = shard_spec(head.weight) if head is not None else None
    if fused is None or spec is None or spec.kind != "tp" or not spec.sharded or spec.dim != 0:
        return

    @functools.wraps(fused)
    def forward(*args, fused_lm_head: bool = False, **kwargs):
        if not fused_lm_head:
            return fused(*args, **kwargs)
        full = types.SimpleNamespace(
            weight=gather_from_sequence_parallel_region(head.weight, 0, spec.group, reduce_grad=False),
            bias=None
            if head.bias is None
            else gather_from_sequence_parallel_region(head.bias, 0, spec.group, reduce_grad=False),
        )
        model.get_output_embeddings = lambda: full
        try:
            out = fused(*args, fused_lm_head=True, **kwargs)
        finally:
            del model.get_output_embeddings
        loss_fn = model.loss_function  # the TP guard checks the loss went through it: it was computed on full rows
        if hasattr(loss_fn, "calls"):
            loss_fn.calls += 1
        return out

    model.forward = forward
