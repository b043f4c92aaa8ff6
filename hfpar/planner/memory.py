"""Activations and host RAM in `hfpar plan`: the output layer as hfpar's recipes compute it, and the host memory
of each rank as hfpar loads the model.

    chunk = chunk_tokens(stats, tp=1, loss_chunk_size=None)       # the recipe's auto chunk (0: unchunked)
    activation_bytes(stats, 4096, 1, loss_chunk=chunk)            # bytes kept for backward on one rank
    host_ram_bytes(stats, STRATEGY["fsdp2"], dp=8)                # {"mode", "load", "steady", "peak"} host bytes

ModelStats: a model's parameter statistics, from its config built on the meta device (model_stats).

Output layer. Unchunked (--loss_chunk_size 0, or where the recipe leaves it off): 4*s*b*v/t, the fp32 logits
(Korthikanti et al. 2022). Chunked (hfpar.parallel.chunked_loss, on by default where the model's logits are its
head's output: chunked_loss.logits_problem; off with pipeline parallelism): the head's forward runs the whole loss
at once and keeps, beyond the body's activations:
  grad_h          the precomputed gradient of the head's input, N x H fp32 (hfpar's fp32 master weights keep the
                  residual stream fp32 under autocast), N = s*b tokens of the rank (the full N under TP)
  one chunk       C x V/t fp32 logits, turned in place into their gradient; in bf16 plus its bf16 copy (dz), and
                  the weight-gradient update of each chunk, (dz^T h) in bf16 and its fp32 copy, made in row blocks
                  of at most C x V/t elements: min(C, H) x (V/t) x (2 + 4);
                  in fp32 the next chunk's logits are formed while the previous ones are alive: 2 chunks
The head's weight gradient (fp32, allocated by forward here, by backward on the unchunked path at the same point
of the step) and the bf16 copy of the weight are in both paths and counted in neither. Checked on CPU against
the peak live tensor bytes of chunked_linear_cross_entropy (N 2048, H 512, V 32768, C 256, a dispatch mode
counting every storage ops create): fp32 200 MiB = these terms 68 + grad_w 64 + views of the inputs 68; bf16
autocast 200 MiB = 100 + grad_w 64 + the bf16 weight 32 + a view of h 4 (248 = 148 + ... before the
weight-gradient update was split into row blocks).

Host RAM per rank (peak = overhead + max(loading, steady state)), from hfpar.loading.sharded.loading_mode:
  full      from_pretrained in fp32 (the recipe's master weights): the whole model, 4 bytes/param, on every rank
            (DDP, ZeRO-1/2, LoRA over them, upcycling without TP / EP), + the checkpoint's pages it maps (its dtype)
  zero3     under DeepSpeed's zero.Init: each rank's fp32 partition, 4/dp bytes/param; rank 0 maps the whole
            checkpoint (transformers reads it there, the other ranks use meta tensors)
  sharded   TP / EP / PP: this rank's slices / its stage, 4 bytes/param held + their checkpoint bytes read
  fsdp2     each rank's dim-0 shard, 4/dp bytes/param + their checkpoint bytes (an upper bound on a GPU: each
            shard goes to the device as it is read)
  steady    what stays in host RAM while training: ZeRO-3 offload's CPU bytes (params, grads, optimizer)
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from hfpar.loading.sharded import loading_mode
from hfpar.loading.sources import causal_lm_problem
from hfpar.parallel.chunked_loss import LOGITS_PER_CHUNK, logits_problem
from hfpar.parallel.language_model import language_model_path, pipeline_refusal, text_config


class PlannerError(ValueError):
    """A bad planner input; the message is one line naming the value and what is valid."""


def state_bytes_per_param(mixed_precision: str) -> tuple[int, int, int]:
    """(param, grad, optimizer) bytes per parameter for Adam."""
    if mixed_precision == "bf16":
        return 2, 2, 12  # bf16 params + bf16 grads + (fp32 master, exp_avg, exp_avg_sq)
    if mixed_precision == "no":
        return 4, 4, 8  # fp32 params + fp32 grads + (exp_avg, exp_avg_sq)
    raise PlannerError(f"--mixed_precision {mixed_precision!r}: use bf16 or no")


# resident memory of a recipe process before it loads a model, a measured floor
# (why: docs/architecture.md#why-loading-data-and-the-planner)
HOST_OVERHEAD = 445 * 2**20
CHECKPOINT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}  # config dtype -> bytes/param of the files


@dataclass(frozen=True)
class ModelStats:
    n_params: int  # unique parameters (tied embeddings once)
    n_tp_replicated: int  # parameters tensor parallelism leaves whole: norms, biases, routers
    n_expert: int  # parameters inside routed experts (split by expert parallelism)
    largest_layer: int  # parameters of the biggest decoder layer (the unit FSDP2 / ZeRO-3 gathers)
    lora_unit: int  # sum of (in + out) over the layers' linear weights: LoRA params = rank x this
    n_layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    num_experts: int  # 0 for dense models
    n_layer_params: int = 0  # parameters of all decoder layers (pipeline stages: hfpar.planner.pipeline)
    n_embed: int = 0  # input embedding
    n_head: int = 0  # output head, also when tied (a pipeline's last stage holds its own copy)
    n_head_untied: int = 0  # n_head when not tied to the embedding, else 0 (then not in n_params)
    model_type: str = ""  # config.model_type
    chunk_problem: str = ""  # why the recipe's chunked LM loss is off for it (chunked_loss.logits_problem), "" if on
    checkpoint_bytes: int = 4  # bytes per parameter of the checkpoint files (config dtype; unknown: fp32)
    pipeline_refusal: str = ""  # why pipeline stages cannot cut it (a multimodal wrapper), "" when they can
    lora_unit_whole: int = 0  # the part of lora_unit on weights TP leaves whole (MoE routers and experts)


def _cfg(config, *names: str, default: int = 0) -> int:
    for n in names:
        v = getattr(config, n, None)
        if v:
            return int(v)
    return default


def untrusted_fields(fields: dict) -> dict:
    """The config as training builds it without --trust_remote_code: a model_type transformers knows is its
    built-in class (auto_map dropped, so nothing downstream takes the model for custom code); an unknown one exists
    only as the custom code, which the planner must not run: refused in one line."""
    if not fields.get("auto_map"):
        return fields
    mt = fields.get("model_type")
    if mt not in CONFIG_MAPPING_NAMES:
        raise PlannerError(
            f"model_type {mt!r} is custom code (the config's auto_map), unknown to transformers; hfpar plan builds "
            "the model to count it, so it runs that code only with --trust_remote_code (read the code first)"
        )
    return {k: v for k, v in fields.items() if k != "auto_map"}


@functools.lru_cache(maxsize=8)
def _stats_from_json(config_cls: type, config_json: str, trust_remote_code: bool) -> ModelStats:
    fields = json.loads(config_json)
    if not trust_remote_code:
        fields = untrusted_fields(fields)
    config = config_cls.from_dict(fields)
    if why := causal_lm_problem(config):
        raise PlannerError(why)
    with torch.device("meta"):
        # model code runs only when the user said so (`hfpar plan --trust_remote_code`), never because a config
        # (a hub repo's, possibly) asks for it with auto_map
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    total = replicated = expert = lora = lora_whole = 0
    per_layer: dict[str, int] = {}
    # a multimodal wrapper: decoder layers are its language model's; its towers stay whole (replicated) under TP
    lm = language_model_path(model)
    embeds = {id(p) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m for p in m.parameters()}
    for name, p in model.named_parameters():  # unique parameters: a tied lm_head is counted once
        n = p.numel()
        total += n
        is_expert = ".experts." in name and "shared_expert" not in name
        expert += n if is_expert else 0
        tower = bool(lm) and not name.startswith(lm + ".") and id(p) not in embeds
        router = bool(re.search(r"\.(gate|router)\.weight$", name))
        if tower or p.dim() < 2 or router:
            replicated += n
        m = re.search(r"\.layers\.(\d+)\.", name)
        if m and not tower:
            per_layer[m.group(1)] = per_layer.get(m.group(1), 0) + n
            if p.dim() >= 2:  # [out, in] or experts [E, a, b]
                unit = (p.shape[0] if p.dim() == 3 else 1) * (p.shape[-1] + p.shape[-2])
                lora += unit
                lora_whole += unit if is_expert or router else 0  # MoE blocks stay whole under TP
    text = text_config(config)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    n_head = head.weight.numel() if head is not None else 0
    tied = head is not None and head.weight is embed.weight
    return ModelStats(
        n_layer_params=sum(per_layer.values()),
        n_embed=embed.weight.numel(),
        n_head=n_head,
        n_head_untied=0 if tied else n_head,
        model_type=getattr(config, "model_type", "") or "",
        chunk_problem=logits_problem(config) or "",
        checkpoint_bytes=CHECKPOINT_BYTES.get(str(fields.get("dtype") or fields.get("torch_dtype")), 4),
        n_params=total,
        n_tp_replicated=replicated,
        n_expert=expert,
        largest_layer=max(per_layer.values(), default=total),
        lora_unit=lora,
        lora_unit_whole=lora_whole,
        n_layers=_cfg(text, "num_hidden_layers", "n_layer", default=1),
        pipeline_refusal=pipeline_refusal(config) or "",
        hidden=_cfg(text, "hidden_size", "n_embd", "d_model"),
        heads=_cfg(text, "num_attention_heads", "n_head"),
        kv_heads=_cfg(text, "num_key_value_heads", "num_attention_heads", "n_head"),
        intermediate=_cfg(text, "moe_intermediate_size", "intermediate_size", "ffn_dim", "n_inner"),
        vocab=_cfg(text, "vocab_size"),
        num_experts=_cfg(text, "num_local_experts", "num_experts", "n_routed_experts"),
    )


def model_stats(config, *, trust_remote_code: bool = False) -> ModelStats:
    """Parameter statistics of a transformers config (built on the meta device: no memory, no weights). A config
    with auto_map runs its code only with trust_remote_code (else: the built-in class of its model_type)."""
    if isinstance(config, ModelStats):
        return config
    return _stats_from_json(type(config), config.to_json_string(use_diff=False), trust_remote_code)


def chunk_tokens(stats, tp: int = 1, loss_chunk_size: int | None = None) -> int:
    """Tokens per chunk of the recipe's chunked LM loss for this model (hfpar.parallelize.chunk_loss), 0 when
    the recipe computes the full logits: --loss_chunk_size 0, or unset (auto) for a model type it is not checked
    for (soft-capped / scaled logits: Gemma 2, Cohere, ...). Auto: LOGITS_PER_CHUNK // (vocab / tp) tokens."""
    if loss_chunk_size == 0 or not stats.vocab or stats.chunk_problem:
        return 0
    return loss_chunk_size or max(1, LOGITS_PER_CHUNK // (stats.vocab // tp))


def output_layer_bytes(stats, tokens: int, *, tp: int = 1, loss_chunk: int = 0, bf16: bool = True) -> int:
    """Bytes the LM head + loss keep on one rank at the step's peak (module docstring): the fp32 logits, or the
    chunked loss's gradient of the head's input and one chunk (0 for a model without a head)."""
    v = stats.vocab // tp if stats.vocab else 0
    if not v:
        return 0
    if not loss_chunk:
        return 4 * tokens * v
    c = min(loss_chunk, tokens)
    grad_h = 4 * tokens * stats.hidden
    if bf16:
        return grad_h + c * v * (4 + 2) + min(c, stats.hidden) * v * (2 + 4)
    return grad_h + (2 if tokens > c else 1) * c * v * 4


def _gated(stats) -> bool:
    """Whether the MLP has three matmuls (SwiGLU / GeGLU: gate, up, down) or two, from a dense layer's weights."""
    if stats.num_experts or not stats.intermediate or not stats.hidden or not stats.heads:
        return True  # MoE experts of today's families are gated
    q = stats.hidden
    kv = stats.kv_heads * stats.hidden // stats.heads
    mlp = stats.largest_layer - stats.hidden * (2 * q + 2 * kv)
    return mlp > 2.5 * stats.hidden * stats.intermediate


def activation_bytes(
    stats,
    seq_len: int,
    batch_size: int,
    *,
    tp: int = 1,
    checkpointing: bool = False,
    act_bytes: int = 2,
    attn_implementation: str = "sdpa",
    loss_chunk: int = 0,
    autocast: bool = True,
) -> int:
    """Activations kept for backward on one rank: measured per layer, Korthikanti et al. 2022's structure.

    hfpar keeps fp32 master weights and computes under bf16 autocast, which Korthikanti's 34 s b h (every saved tensor
    16-bit, a 4h GELU MLP) undercounts: the residual stream and the RMSNorms stay fp32, RoPE's output is fp32 (fp32
    cos / sin), and autocast's bf16 copy of every weight is saved for its matmul's backward. Per token and layer,
    the saved-tensor bytes of transformers' Llama decoder layer (sdpa, packed rows; benchmarks/common/
    activation_bytes.py, CPU, any shape: the terms below fit h 1024-3072, I 2816-8192, kv 512-1024 exactly):
      bf16 autocast over fp32 weights (autocast True: DDP, one process, TP / EP / CP / PP over DDP):
                     26 h + 4 q + 4 kv + 8 I (+ 4 per head: sdpa's fp32 logsumexp)
      bf16 weights (autocast False: FSDP2's bf16 policy gathers bf16 weights, DeepSpeed's bf16 casts the module):
                     16 h + 4 q + 4 kv + 8 I (+ 4 per head), no weight copies, a bf16 residual stream
      fp32:          24 h + 8 q + 8 kv + 16 I (+ 4 per head)
    q = h (the heads' width), kv = kv_heads x h / heads, I the MLP's width (gated; a two-matmul MLP saves half the
    I term). With TP degree t the q, kv and I terms are split, the h term (norms, residual, the matmuls' full-width
    inputs) is not. Under autocast the bf16 weight copies add 2 bytes per layer parameter (/ t for the split
    matrices). Eager attention adds the s x s scores, 5 a s / t per token (16-bit units, Korthikanti). Full
    recomputation keeps each layer's input (4 h per token fp32, 2 h bf16), plus one layer's activations and weight
    copies while it is recomputed.
    Output layer: output_layer_bytes (loss_chunk tokens per chunk, 0: 4*s*b*v/t fp32 logits).
    Checked against the GPU (H200, bf16, one process, benchmarks/results/gpu/round/): a 0.9B Llama at 2048 x 8
    tokens, peak 42.0 GiB measured; a 3.2B Llama at 2 rows padded to 4000, 81.7 GiB (docs/planner.md)."""
    s, b, h, a = seq_len, batch_size, stats.hidden, stats.heads
    bf16 = act_bytes == 2
    q = h
    kv = stats.kv_heads * h // a if a else h
    mlp = stats.intermediate * (1 if _gated(stats) else 0.5)
    if bf16:
        per_token = (26 if autocast else 16) * h + (4 * q + 4 * kv + 8 * mlp) / tp + 4 * a / tp
    else:
        per_token = 24 * h + (8 * q + 8 * kv + 16 * mlp) / tp + 4 * a / tp
    if attn_implementation == "eager":
        per_token += 5 * a * s / tp * act_bytes / 2
    copies = 0.0
    if bf16 and autocast and stats.n_layers:
        copies = 2 * stats.largest_layer / tp  # the pipeline planner passes n_layers=1 copies of the stats: per layer
    layer = s * b * per_token + copies
    kept_input = 2 if bf16 and not autocast else 4  # bytes per element of a layer's input (the residual stream)
    body = stats.n_layers * kept_input * s * b * h + layer if checkpointing else stats.n_layers * layer
    head = output_layer_bytes(stats, s * b, tp=tp, loss_chunk=loss_chunk, bf16=bf16)
    return int(body + head)


def load_mode(stats, strategy, *, tp: int = 1, ep: int = 1, pp: int = 1, lora: bool = False) -> str:
    """hfpar.loading.sharded.loading_mode for a planner row (strategy: a hfpar.backends.Strategy): sharded | fsdp2 |
    full (ZeRO-3 offload loads as ZeRO-3)."""
    args = SimpleNamespace(use_peft=lora, upcycle_experts=False, sharded_loading=True)
    config = SimpleNamespace(model_type=stats.model_type, num_experts=stats.num_experts)
    return loading_mode(args, SimpleNamespace(tp=tp, ep=ep, pp=pp, strategy=strategy), config)[0]


def host_ram_bytes(
    stats,
    strategy,
    *,
    dp: int,
    tp: int = 1,
    ep: int = 1,
    pp: int = 1,
    lora: bool = False,
    local: float | None = None,
    cpu: float = 0,
) -> dict:
    """Host RAM of the most loaded rank (module docstring): {"mode", "load", "steady", "peak"} in bytes, peak
    with HOST_OVERHEAD. strategy: a hfpar.backends.Strategy; local: parameters the rank holds after TP / EP
    (default all); cpu: offloaded bytes."""
    n, c = stats.n_params, stats.checkpoint_bytes
    mode = load_mode(stats, strategy, tp=tp, ep=ep, pp=pp, lora=lora)
    if mode == "sharded":
        held = read = n if local is None else local
    elif mode == strategy.wrap_load:  # the wrap reads each rank's shard (FSDP2)
        held = read = n / dp
    elif strategy.partitions_at_load:  # zero.Init: each rank's partition held, the whole checkpoint read
        held, read = n / dp, n
    else:
        held = read = n
    load = 4 * held + c * read
    return {"mode": mode, "load": int(load), "steady": int(cpu), "peak": int(HOST_OVERHEAD + max(load, cpu))}
