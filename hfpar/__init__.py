"""hfpar: fine-tune Hugging Face transformers with DDP, FSDP2, DeepSpeed ZeRO, tensor and expert parallelism.

    from hfpar import apply_tensor_parallel, ColumnParallelLinear, RowParallelLinear
    model = apply_tensor_parallel(model, tp_group)     # in your own Accelerate / torch loop

Names are imported lazily so `import hfpar` stays cheap.
"""

__version__ = "0.1.0"

_LAZY = {
    "apply_tensor_parallel": "hfpar.parallel.apply",
    "sync_sequence_parallel_grads": "hfpar.parallel.apply",
    "clip_tp_grad_norm_": "hfpar.parallel.apply",
    "tp_grad_norm": "hfpar.parallel.apply",
    "gather_full_state_dict": "hfpar.parallel.apply",
    "ColumnParallelLinear": "hfpar.parallel.tensor",
    "RowParallelLinear": "hfpar.parallel.tensor",
    "VocabParallelEmbedding": "hfpar.parallel.tensor",
    "vocab_parallel_cross_entropy": "hfpar.parallel.tensor",
    "TopKRouter": "hfpar.parallel.moe",
    "GroupedExperts": "hfpar.parallel.moe",
    "MoELayer": "hfpar.parallel.moe",
    "apply_expert_parallel": "hfpar.parallel.moe_apply",
    "upcycle_to_moe": "hfpar.parallel.moe_apply",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hfpar' has no attribute {name!r}")
