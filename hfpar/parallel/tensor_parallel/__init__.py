"""Tensor parallelism: Megatron-style layers, per-architecture plans as data, and apply_tensor_parallel.

layers.py    ColumnParallelLinear, RowParallelLinear (params.py: their shared parameter helpers)
embedding.py VocabParallelEmbedding
conv1d.py    ColumnParallelConv1D, RowParallelConv1D (transformers' Conv1D: GPT-2)
loss.py      vocab_parallel_cross_entropy (from logit shards)
hf_loss.py   model(**batch).loss / generate() on a TP model; gather_vocab_logits, full_vocab_logits
plans.py     written plans per model_type;  derived.py  plans from HF's config.base_model_tp_plan
infer.py     plans inferred from the modules;  sequence_plan.py  sequence-parallel entries from the structure
norms.py     ShardedRMSNorm (a norm over all heads on sharded heads)
shape_check.py  the plan matched to the modules, names / shapes / degrees checked (no compute, no collective)
block_check.py  the plan checked numerically: sharded copies of the blocks against unsharded ones (fp64)
hooks.py     the forward hooks (regions, sequence split / gather, per-head ALiBi);  rng.py  dropout in a region per rank
apply.py     apply_tensor_parallel (+ sequence parallelism) on an HF model, in place: which plan, then
shard_modules.py  each matched module replaced or hooked by its style
grads.py     sync_sequence_parallel_grads, clip_tp_grad_norm_, gather_full_state_dict (users' own loops)
"""

from ..exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".apply": (
            "apply_tensor_parallel",
            "clip_tp_grad_norm_",
            "gather_full_state_dict",
            "sequence_parallel_grad_hooks",
            "sync_sequence_parallel_grads",
            "tp_grad_norm",
        ),
        ".conv1d": (
            "ColumnParallelConv1D",
            "RowParallelConv1D",
        ),
        ".derived": (
            "derive_plan",
            "derived_plan_problem",
            "derived_plan_refusal",
        ),
        ".hf_loss": (
            "VocabParallelCausalLMLoss",
            "full_vocab_logits",
            "gather_vocab_logits",
        ),
        ".layers": (
            "ColumnParallelLinear",
            "RowParallelLinear",
            "VocabParallelEmbedding",
            "gather_shards",
            "shard_tensor",
            "tp_sharded_parameters",
        ),
        ".loss": ("vocab_parallel_cross_entropy",),
        ".plans": ("get_plan",),
    },
)
