"""Tensor-parallel plans as data: {model_type: {module-path pattern: style}}.

    python -c "from hfpar.parallel.tensor_parallel.plans import get_plan; print(get_plan('llama'))"

A pattern matches a module's full path in the HF model (`model.layers.3.self_attn.q_proj`):
`*` matches one path component (no dots); a pattern starting with `re:` is a full-match regex.
Styles (`apply.py` turns them into layers and hooks):

    vocab_embedding      nn.Embedding -> VocabParallelEmbedding (rows of the vocab split; output all-reduced)
    colwise              nn.Linear -> ColumnParallelLinear, output features split (q/k/v, gate/up)
    colwise_packed:RULE  the same for a fused projection; RULE names the part sizes, each part split on
                         its own ("qkv" -> [q, k, v] from the config, "gate_up" -> [I, I]) or lists
                         them ("colwise_packed:64,32,32")
    rowwise              nn.Linear -> RowParallelLinear, input features split (o_proj, down_proj)
                         (colwise / colwise_packed / rowwise on transformers' Conv1D: the Conv1D versions)
    rowwise_heads        rowwise whose OUTPUT is one value per head, computed from all heads' features (Doge's
                         dt_proj: every value head -> a mask strength per kv head): the partial sums are
                         reduce-scattered along the output features, each rank keeps its heads' values (backward:
                         all-gather); no bias
    colwise_lm_head      lm_head -> ColumnParallelLinear without gather: logits are vocab shards (B, T, V/tp)
    attention            the module holding q/k/v/o. Its input enters the TP region once (backward: one
                         all-reduce, or under sequence parallelism one all-gather of T forward and one
                         reduce-scatter backward) and its column layers use it as is. Head counts are
                         validated and set per rank on the module.
    mlp                  the same region for the MLP (gate/up/down); intermediate_size validated.
                         A region's input may feed only the plan's column layers (every Linear inside
                         a region needs a plan entry; checked).
    sequence_scatter     the first decoder layer: under sequence parallelism its input is split along T
    sequence_gather      the final norm, when the model reshapes its output to the input's (B, T) (GPT-2): under
                         sequence parallelism its input is all-gathered along T (it and the LM head then run on
                         the full sequence; default: the LM head gathers T itself)
    replicated_sp        replicated (norms); under sequence parallelism each rank sees T/tp tokens, so
                         the gradient is summed over the TP group (`sync_sequence_parallel_grads`)
    replicated_heads     replicated but applied to this rank's heads only (Qwen3 q_norm / k_norm on
                         head_dim; MLA's latent down-projections): forward exact, gradient partial -> summed
                         over TP by a backward hook, with or without SP. Every other parameter inside a region
                         that no entry names is treated the same way (Apertus' learnable activation).
    sharded_rmsnorm      an RMSNorm over ALL heads (OLMo-2's q_norm over the whole q projection) -> ShardedRMSNorm
                         (norms.py): weight split like the projection it follows, sum of squares all-reduced
    head_param           a PARAMETER (the pattern names it, not a module) laid out by head along dim 0 (attention
                         sinks (H,), a per-head gate bias): split with the heads, gathered on export
    output_param         a PARAMETER of a region applied after its output projection's all-reduce (GPT-NeoX-
                         Japanese's dense_bias, returned by the attention and added by the layer): replicated with
                         its full gradient (a region's other parameters act on this rank's heads: summed over TP)

Modules not named by a plan stay replicated (plain parameters, identical on every rank).
Users can pass their own plan (same format) to `apply_tensor_parallel(model, plan=...)`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ..errors import ParallelError

__all__ = [
    "TP_PLANS",
    "TESTED_MODEL_TYPES",
    "TESTED_DERIVED_MODEL_TYPES",
    "STYLES",
    "PARAM_STYLES",
    "PACKED_SPLIT_RULES",
    "get_plan",
    "reroot_plan",
    "compile_pattern",
    "packed_splits",
]

STYLES = (
    "vocab_embedding",
    "colwise",
    "colwise_packed",
    "rowwise",
    "rowwise_heads",
    "colwise_lm_head",
    "attention",
    "attention_widths",
    "mlp",
    "sequence_scatter",
    "sequence_gather",
    "replicated_sp",
    "replicated_heads",
    "sharded_rmsnorm",
    "head_param",
    "output_param",
)
PARAM_STYLES = ("head_param", "output_param")  # matched against parameter names, not module names


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _kv_heads(cfg) -> int:
    return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads


# Fused projections: full part sizes, in the order they are concatenated in the weight's rows.
PACKED_SPLIT_RULES = {
    "qkv": lambda cfg: [
        cfg.num_attention_heads * _head_dim(cfg),
        _kv_heads(cfg) * _head_dim(cfg),
        _kv_heads(cfg) * _head_dim(cfg),
    ],
    "gate_up": lambda cfg: [cfg.intermediate_size, cfg.intermediate_size],
}


# The Llama layout, shared by most decoder-only families.
_LLAMA = {
    "model.embed_tokens": "vocab_embedding",
    "model.layers.0": "sequence_scatter",
    "model.layers.*.input_layernorm": "replicated_sp",
    "model.layers.*.self_attn": "attention",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.post_attention_layernorm": "replicated_sp",
    "model.layers.*.mlp": "mlp",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "model.norm": "replicated_sp",
    "lm_head": "colwise_lm_head",
}

TP_PLANS: dict[str, dict[str, str]] = {
    "llama": dict(_LLAMA),
    "mistral": dict(_LLAMA),
    "qwen2": dict(_LLAMA),  # q/k/v biases are split with their rows
    # Parity-tested on one tiny config each (tests/distributed/test_tp_models.py), beyond the llama/mistral/qwen2
    # contract:
    "qwen3": {
        **_LLAMA,  # per-head q/k RMSNorm over head_dim
        "model.layers.*.self_attn.q_norm": "replicated_heads",
        "model.layers.*.self_attn.k_norm": "replicated_heads",
    },
    "phi3": {k: v for k, v in _LLAMA.items() if ".self_attn." not in k and ".mlp." not in k}
    | {
        "model.layers.*.self_attn.qkv_proj": "colwise_packed:qkv",
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.mlp.gate_up_proj": "colwise_packed:gate_up",
        "model.layers.*.mlp.down_proj": "rowwise",
    },
    "gemma": dict(_LLAMA),  # tied embeddings by default: lm_head shares the shard
    "gemma2": {
        **_LLAMA,  # + sandwich norms; logit soft-capping is elementwise
        "model.layers.*.pre_feedforward_layernorm": "replicated_sp",
        "model.layers.*.post_feedforward_layernorm": "replicated_sp",
    },
}
# Encoders (BERT and its relatives: MiniLM, ...): the region is the self-attention module, whose input feeds
# only q/k/v (BertAttention's input also feeds the residual inside BertSelfOutput, which must not be summed
# over the TP ranks); the MLP region is `intermediate` (dense + act), `output.dense` takes its shards.
# Embeddings other than the word embeddings, LayerNorms, pooler and task heads stay replicated.
_ENC = r"re:(?:bert\.)?encoder\.layer\.\d+"
TP_PLANS["bert"] = {
    r"re:(?:bert\.)?embeddings\.word_embeddings": "vocab_embedding",
    _ENC + r"\.attention\.self": "attention",
    _ENC + r"\.attention\.self\.(?:query|key|value)": "colwise",
    _ENC + r"\.attention\.output\.dense": "rowwise",
    _ENC + r"\.intermediate": "mlp",
    _ENC + r"\.intermediate\.dense": "colwise",
    _ENC + r"\.output\.dense": "rowwise",
}
# GPT-2: transformers' Conv1D layers (weight (in, out)) -> ColumnParallelConv1D / RowParallelConv1D (conv1d.py);
# c_attn is q|k|v packed along its output features; wpe (positions) stays replicated; lm_head is tied to wte.
_H = "transformer.h"
TP_PLANS["gpt2"] = {
    "transformer.wte": "vocab_embedding",
    f"{_H}.0": "sequence_scatter",
    f"{_H}.*.ln_1": "replicated_sp",
    f"{_H}.*.attn": "attention",
    f"{_H}.*.attn.c_attn": "colwise_packed:qkv",
    f"{_H}.*.attn.c_proj": "rowwise",
    f"{_H}.*.ln_2": "replicated_sp",
    f"{_H}.*.mlp": "mlp",
    f"{_H}.*.mlp.c_fc": "colwise",
    f"{_H}.*.mlp.c_proj": "rowwise",
    "transformer.ln_f": "sequence_gather",  # GPT2Model views its output to the input's (B, T): gather T first
    "lm_head": "colwise_lm_head",
}
TESTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "bert", "gpt2")
# Families whose plan is derived from HF's config.base_model_tp_plan (derived.py), parity-tested (TP, no SP)
# in tests/distributed/test_tp_derived_plans.py (its cases are this list; DeepSeek-V2, Qwen3.5 and Gemma-4 text are
# parity-tested in test_tp_family_sweep.py and, the first two, tests/launch/test_tp_families_recipe.py; so are Llama-4
# text, MiMo-V2-Flash and Doge, in test_tp_family_sweep.py);
# every other family with a mappable base_model_tp_plan is derived untested.
# MoE families: attention (and dense MLPs) tensor-parallel, MoE blocks whole on every TP rank (EP splits them)
TESTED_DERIVED_MODEL_TYPES = (
    "granite",
    "starcoder2",
    "smollm3",
    "olmo",
    "cohere",
    "phi",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmo2",
    "glm4",
    "minicpm3",
)


# Families without a plan or a base_model_tp_plan whose inferred plan (infer.py) is parity-tested
# (tests/distributed/test_tp_verify.py, test_tp_family_sweep.py, tests/launch/test_tp_families_recipe.py); every other
# one is inferred and verified at apply time
TESTED_INFERRED_MODEL_TYPES = (
    "gpt_bigcode",
    "falcon",
    "bloom",
    "mpt",
    "persimmon",
    "hunyuan_v1_moe",
    "gpt_oss",
    "afmoe",
    "ctrl",
    "modernbert-decoder",
    "bitnet",
    "gpt_neox_japanese",
    "diffllama",
)


def get_plan(model_type: str) -> dict[str, str]:
    """A copy of the built-in plan for `model_type`; ValueError naming it and the supported ones."""
    if model_type not in TP_PLANS:
        raise ParallelError(
            "apply_tensor_parallel",
            [
                f"no written tensor-parallel plan for model_type {model_type!r}; "
                f"written: {', '.join(sorted(TP_PLANS))} (tested: {', '.join(TESTED_MODEL_TYPES)}); "
                f"others are derived from the config's base_model_tp_plan (derived.py). "
                f"Pass plan={{module pattern: style}} for other architectures."
            ],
        )
    return dict(TP_PLANS[model_type])


def reroot_plan(plan: Mapping[str, str], model_type: str, lm_path: str, head: str | None) -> dict[str, str]:
    """A written plan (paths of a text *ForCausalLM: `model.layers.*...`, `lm_head`) moved onto a multimodal
    wrapper whose language model sits at `lm_path` (`model.language_model`): the first component (the text model's
    base prefix) becomes lm_path, the LM head entry names `head` (the wrapper's output embedding; None: dropped)."""
    out = {}
    for pattern, style in plan.items():
        if style == "colwise_lm_head":
            if head is not None:
                out[head] = style
        elif pattern.startswith("re:") or "." not in pattern:
            raise ParallelError(
                "apply_tensor_parallel",
                [f"the written plan of {model_type!r} cannot be moved under {lm_path!r} ({pattern!r}); pass plan="],
            )
        else:
            out[f"{lm_path}.{pattern.partition('.')[2]}"] = style
    return out


def compile_pattern(pattern: str) -> re.Pattern:
    """`*` = one path component; `re:...` = a regex matched against the whole path."""
    if pattern.startswith("re:"):
        return re.compile(pattern[3:])
    return re.compile("[^.]+".join(re.escape(p) for p in pattern.split("*")))


def packed_splits(style: str, config) -> list[int] | None:
    """Part sizes for "colwise_packed:RULE" (None for every other style)."""
    base, _, rule = style.partition(":")
    if base != "colwise_packed":
        return None
    if rule in PACKED_SPLIT_RULES:
        return PACKED_SPLIT_RULES[rule](config)
    try:
        return [int(s) for s in rule.split(",")]
    except ValueError:
        raise ValueError(
            f"tensor-parallel plan: style {style!r} needs a split rule "
            f"({' | '.join(PACKED_SPLIT_RULES)} | comma-separated sizes)"
        ) from None


def validate_plan(plan: Mapping[str, str]) -> None:
    bad = [
        f"{p!r}: {s!r}"
        for p, s in plan.items()
        if s.partition(":")[0] not in STYLES or (s.partition(":")[0] == "colwise_packed") != bool(s.partition(":")[2])
    ]
    if bad:
        raise ValueError(
            f"tensor-parallel plan: unknown style(s) {', '.join(bad)}; styles: {', '.join(STYLES)} "
            f"(colwise_packed needs ':RULE')"
        )
