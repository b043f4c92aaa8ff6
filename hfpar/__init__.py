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

from hfpar.parallel.exports import lazy_exports

__version__ = "0.1.0"

# transformers imports torchao whenever it is installed (its quantizer registry), and torchao 0.18 under another torch
# than its compiled kernels were built for logs "Failed to load ..._C...so" and torch's Enum-registration deprecation,
# on every process, fp8 or not: two or four lines before each refusal or log line of a run. hfpar's fp8 uses none of
# those kernels (float8 training is torchao's Python + torch._scaled_mm), and what fp8 needs is checked by the
# preflight in one line, so these two loggers are set to errors only.
for _noisy in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "hfpar.parallel.tensor_parallel": (
            "apply_tensor_parallel",
            "sync_sequence_parallel_grads",
            "clip_tp_grad_norm_",
            "tp_grad_norm",
            "gather_full_state_dict",
            "ColumnParallelLinear",
            "RowParallelLinear",
            "VocabParallelEmbedding",
            "vocab_parallel_cross_entropy",
            "full_vocab_logits",
            "gather_vocab_logits",
        ),
        "hfpar.parallel.expert_parallel": (
            "TopKRouter",
            "GroupedExperts",
            "MoELayer",
            "apply_expert_parallel",
            "upcycle_to_moe",
            "expert_parallel_groups",
            "expert_parameters",
            "non_expert_parameters",
        ),
        "hfpar.parallel.sharding": (
            "ShardSpec",
            "shard_spec",
            "clip_grads_",
            "full_state_dict",
        ),
        "hfpar.context": ("ParallelContext",),
        "hfpar.integrations": (
            "parallelize",
            "prepare_trainer",
            "prepare_accelerator",
            "gathered_state_dict",
            "gathered_grads",
        ),
        "hfpar.parallel.context_parallel": (
            "register_cp_attention",
            "shard_batch",
            "cp_rows",
        ),
        "hfpar.parallel.pipeline": (
            "PipelineStage",
            "PipelineRunner",
            "balanced_split",
        ),
        "hfpar.train.varlen": ("register_varlen_attention",),
    },
)
