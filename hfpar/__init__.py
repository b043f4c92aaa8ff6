"""hfpar: fine-tune Hugging Face transformers with DDP, FSDP2, DeepSpeed ZeRO, and tensor, expert, context and
pipeline parallelism.

    from hfpar import apply_tensor_parallel, apply_expert_parallel, upcycle_to_moe, ColumnParallelLinear,
    RowParallelLinear
    model = apply_tensor_parallel(model, tp_group)     # in your own Accelerate / torch loop
    apply_expert_parallel(model, ep_group=ep_group)    # MoE blocks: each rank keeps E / ep experts

Context and pipeline parallelism are in hfpar.parallel.context_parallel (attention registered as "hfpar_cp",
shard_batch, cp_rows) and hfpar.parallel.pipeline (PipelineStage, balanced_split, PipelineRunner); the recipes
run all four with --tp_size / --ep_size / --cp_size / --pp_size (docs/own-code.md, docs/architecture.md).

Names are imported lazily so `import hfpar` stays cheap (torch + transformers: ~4 s per process).
"""

import logging

__version__ = "0.1.0"

# transformers imports torchao whenever it is installed (its quantizer registry), and torchao 0.18 under another torch
# than its compiled kernels were built for logs "Failed to load ..._C...so" and torch's Enum-registration deprecation,
# on every process, fp8 or not: two or four lines before each refusal or log line of a run. hfpar's fp8 uses none of
# those kernels (float8 training is torchao's Python + torch._scaled_mm), and what fp8 needs is checked by the
# preflight in one line, so these two loggers are set to errors only.
for _noisy in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)

_LAZY = {
    "apply_tensor_parallel": "hfpar.parallel.tensor_parallel",
    "sync_sequence_parallel_grads": "hfpar.parallel.tensor_parallel",
    "clip_tp_grad_norm_": "hfpar.parallel.tensor_parallel",
    "tp_grad_norm": "hfpar.parallel.tensor_parallel",
    "gather_full_state_dict": "hfpar.parallel.tensor_parallel",
    "ColumnParallelLinear": "hfpar.parallel.tensor_parallel",
    "RowParallelLinear": "hfpar.parallel.tensor_parallel",
    "VocabParallelEmbedding": "hfpar.parallel.tensor_parallel",
    "vocab_parallel_cross_entropy": "hfpar.parallel.tensor_parallel",
    "TopKRouter": "hfpar.parallel.expert_parallel",
    "GroupedExperts": "hfpar.parallel.expert_parallel",
    "MoELayer": "hfpar.parallel.expert_parallel",
    "apply_expert_parallel": "hfpar.parallel.expert_parallel",
    "upcycle_to_moe": "hfpar.parallel.expert_parallel",
    "expert_parallel_groups": "hfpar.parallel.expert_parallel",
    "ShardSpec": "hfpar.parallel.sharding",
    "shard_spec": "hfpar.parallel.sharding",
    "clip_grads_": "hfpar.parallel.sharding",
    "full_state_dict": "hfpar.parallel.sharding",
    "ParallelContext": "hfpar.context",
    "parallelize": "hfpar.integrations",
    "prepare_trainer": "hfpar.integrations",
    "prepare_accelerator": "hfpar.integrations",
    "gathered_state_dict": "hfpar.integrations",
    "gathered_grads": "hfpar.integrations",
    "full_vocab_logits": "hfpar.parallel.tensor_parallel",
    "gather_vocab_logits": "hfpar.parallel.tensor_parallel",
    "expert_parameters": "hfpar.parallel.expert_parallel",
    "non_expert_parameters": "hfpar.parallel.expert_parallel",
    "register_cp_attention": "hfpar.parallel.context_parallel",
    "shard_batch": "hfpar.parallel.context_parallel",
    "cp_rows": "hfpar.parallel.context_parallel",
    "PipelineStage": "hfpar.parallel.pipeline",
    "PipelineRunner": "hfpar.parallel.pipeline",
    "balanced_split": "hfpar.parallel.pipeline",
    "register_varlen_attention": "hfpar.train.varlen",
}

__all__ = sorted(_LAZY)


def __dir__():
    """The public API for dir(hfpar) / autocomplete (names are imported on first access)."""
    return sorted({*globals(), *_LAZY})


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hfpar' has no attribute {name!r}")
