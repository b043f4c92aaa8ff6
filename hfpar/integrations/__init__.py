"""hfpar's layers inside the training code people already have: transformers.Trainer, TRL's trainers, an Accelerate
loop (docs/own-code.md).

    ctx = parallelize(model, tp_size=2, ep_size=1)   # shard in place over the launched world; refuses without one
    prepare_trainer(trainer)                         # Trainer / SFTTrainer / DPOTrainer: before trainer.train()
    prepare_accelerator(accelerator, ctx)            # an Accelerate loop: before accelerator.prepare(model, ...)

  model.py        parallelize, finish_grads, clip_grad_norm_, gathered_state_dict, save_pretrained, gathered_grads
  accelerator.py  the Accelerator's wrap (DDP over the dp group), data sharding by dp rank, clipping, saving
  trainer.py      prepare_accelerator for the trainer's Accelerator, collective save_model, TRL's fused LM head
  context_parallel.py  cp_batch: a batch cut for a cp rank with the label shift done once (examples/cp_loop.py)
  pipeline.py     the loss_fn contract, tied grads + one norm over the stages, the merged HF checkpoint (pp_loop.py)

A model sharded by apply_tensor_parallel / apply_expert_parallel and handed to stock DDP, accelerator.prepare,
Trainer or fully_shard without these calls is refused in one line (hfpar.parallel.guard).
"""

from .accelerator import prepare_accelerator
from .context_parallel import count_targets, cp_batch
from .model import (
    clip_grad_norm_,
    context_of,
    finish_grads,
    gathered_grads,
    gathered_state_dict,
    parallelize,
    save_pretrained,
)
from .pipeline import causal_lm_loss_fn, pipeline_clip_grad_norm_, pipeline_state_dict, save_pipeline_pretrained
from .trainer import prepare_trainer

__all__ = [
    "causal_lm_loss_fn",
    "clip_grad_norm_",
    "context_of",
    "count_targets",
    "cp_batch",
    "finish_grads",
    "gathered_grads",
    "gathered_state_dict",
    "parallelize",
    "pipeline_clip_grad_norm_",
    "pipeline_state_dict",
    "prepare_accelerator",
    "prepare_trainer",
    "save_pipeline_pretrained",
    "save_pretrained",
]
