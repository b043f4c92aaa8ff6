"""Tensor parallelism: Megatron-style layers, per-architecture plans as data, and apply_tensor_parallel.

    layers.py    ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    loss.py      vocab_parallel_cross_entropy (from logit shards)
    plans.py     plans per model_type;  validate.py  plan / degree checks before any collective
    apply.py     apply_tensor_parallel (+ sequence parallelism) on an HF model, in place
"""

from .apply import (apply_tensor_parallel, clip_tp_grad_norm_, gather_full_state_dict, sequence_parallel_grad_hooks,
                    sync_sequence_parallel_grads, tp_grad_norm)
from .layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, gather_shards, shard_tensor,
                     tp_sharded_parameters)
from .loss import vocab_parallel_cross_entropy
from .plans import get_plan

__all__ = ["apply_tensor_parallel", "clip_tp_grad_norm_", "gather_full_state_dict", "sequence_parallel_grad_hooks",
           "sync_sequence_parallel_grads", "tp_grad_norm", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "gather_shards", "shard_tensor", "tp_sharded_parameters", "vocab_parallel_cross_entropy",
           "get_plan"]
