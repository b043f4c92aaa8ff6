"""The optimizer every backend builds: AdamW with HF Trainer's weight-decay rule.

    optimizer = build_optimizer(model, args)                  # args: learning_rate, weight_decay, adam_*
"""

from __future__ import annotations

import torch


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
