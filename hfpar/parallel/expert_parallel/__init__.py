"""Mixture-of-experts and expert parallelism: router, grouped experts, all-to-all MoE layer, apply, upcycle.

router.py    TopKRouter (softmax top-k, aux / z losses injected in backward), moe_token_mask
moe.py       GroupedExperts, MoELayer (expert-parallel all-to-all dispatch / combine)
families.py  which HF modules are MoE blocks: MOE_FAMILIES (data), generic detection
hf_experts.py  any other HF MoE block: its own code, only its experts module sharded by expert (checked first)
hf_experts_detect.py  which modules those are (find_hf_experts), and why not the others
apply.py     apply_expert_parallel (HF's aux-loss semantics, or hfpar's global aux loss on request)
params.py    expert_parallel_groups, expert_parameters / non_expert_parameters, attach_moe_token_mask, export
hf_outputs.py  router logits for HF's output_router_logits / aux_loss after conversion
upcycle.py   upcycle_to_moe (dense -> MoE: every SwiGLU MLP, found by what it holds)
upcycle_check.py  which HF MoE architecture reproduces an upcycled model (a tiny copy decides), upcycle_problem
upcycle_export.py  upcycled_hf_config, save_upcycled_pretrained
"""

from ..exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".apply": (
            "MOE_FAMILIES",
            "apply_expert_parallel",
            "attach_moe_token_mask",
            "expert_parallel_groups",
            "expert_parameters",
            "gather_expert_state_dict",
            "non_expert_parameters",
        ),
        ".families": (
            "config_num_experts",
            "has_moe_blocks",
            "inside",
            "moe_replaced_paths",
        ),
        ".moe": (
            "GroupedExperts",
            "MoELayer",
        ),
        ".router": (
            "TopKRouter",
            "moe_token_mask",
            "set_aux_loss_grad_scale",
            "set_aux_loss_loss_scale",
        ),
        ".upcycle": (
            "is_upcycled",
            "upcycle_to_moe",
        ),
        ".upcycle_check": ("upcycle_problem",),
        ".upcycle_export": (
            "save_upcycled_pretrained",
            "upcycled_hf_config",
        ),
    },
)
