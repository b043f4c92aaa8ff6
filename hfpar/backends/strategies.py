"""The strategy table: every data-parallel strategy hfpar knows, and what differs between them, as data.

    strategy = resolve_strategy(accelerator)      # once, by the preflight; carried as ctx.strategy
    strategy.name, strategy.layout, strategy.shards, strategy.wrap_load, strategy.adjust_model(model)
    STRATEGY["zero3"].partitions_at_load           # any module: read attributes, never compare names

Outside hfpar.backends nothing compares a strategy's name: the loader, the planner, the preflight's resume check
and the recipe read these attributes instead (tests/unit/test_strategy_knowledge.py keeps it so). The support
matrix (which backend runs a strategy with which model parallelism) is hfpar.backends.SUPPORT.
"""

from __future__ import annotations

from dataclasses import dataclass

from accelerate.utils import DistributedType


@dataclass(frozen=True)
class Strategy:
    name: str  # the accelerate config's name (single | ddp | fsdp2 | zero1 ...)
    label: str  # how `hfpar plan` names it
    layout: str  # checkpoint family: training states resume only within one family
    deepspeed: bool = False  # DeepSpeed's engine: it steps inside backward, owns its fp16 loss scale,
    # and its ZeRO partitions resume on the world size that wrote them only
    shards: tuple[bool, bool, bool] = (False, False, False)  # params, grads, optimizer states split over dp
    buffers: str = "bucket"  # transient bytes (planner): bucket (DDP's grad copy), gathered (one
    # layer all-gathered + prefetched), reduce_bucket (ZeRO-1/2's)
    wrap_load: str | None = None  # loading mode in which the wrap reads each rank's shards (FSDP2)
    partitions_at_load: bool = False  # from_pretrained under DeepSpeed's zero.Init (ZeRO-3)
    offload: bool = False  # states kept in host RAM (ZeRO-3 offload)
    holds_embedding_units: bool = False  # Accelerate's FSDP2 gives the input embedding a unit of its own
    fp8_all_gather: bool = False  # its wrap all-gathers torchao's Float8Linear weights in fp8 (tensorwise fp8)
    bf16_weights: bool = False  # under bf16 the model computes with bf16 weights (FSDP2's policy, DeepSpeed's cast),
    # not autocast over fp32 ones: smaller activations (planner), no bf16 weight copies
    planner_with: str = ""  # what `hfpar plan` composes it with: tp, ep, cp, pp (over it)
    tier: str | None = None  # `hfpar plan`'s recommendation order: first | fallback | last (None:
    # shown, not recommended)
    in_planner: bool = False  # a row of `hfpar plan`'s table
    runs: bool = True  # an accelerate config resolves to it (zero3_offload runs as zero3)

    def __str__(self) -> str:
        return self.name

    def adjust_model(self, model) -> None:
        """Before parallelism is applied (hfpar.parallelize): what this strategy's wrap needs of the model."""
        if self.holds_embedding_units:
            fsdp2_wrap_classes(model)


_TABLE = (
    Strategy("single", "single", "accelerate"),
    Strategy("ddp", "DDP", "accelerate", in_planner=True, planner_with="tp ep cp pp", tier="first"),
    Strategy(
        "fsdp2",
        "FSDP2",
        "fsdp2",
        in_planner=True,
        shards=(True, True, True),
        buffers="gathered",
        wrap_load="fsdp2",
        holds_embedding_units=True,
        fp8_all_gather=True,
        bf16_weights=True,
        planner_with="tp cp",
        tier="first",
    ),
    Strategy(
        "zero1",
        "ZeRO-1",
        "deepspeed",
        in_planner=True,
        deepspeed=True,
        bf16_weights=True,
        shards=(False, False, True),
        buffers="reduce_bucket",
    ),
    Strategy(
        "zero2",
        "ZeRO-2",
        "deepspeed",
        in_planner=True,
        deepspeed=True,
        bf16_weights=True,
        shards=(False, True, True),
        buffers="reduce_bucket",
    ),
    Strategy(
        "zero3",
        "ZeRO-3",
        "deepspeed",
        in_planner=True,
        deepspeed=True,
        bf16_weights=True,
        shards=(True, True, True),
        buffers="gathered",
        partitions_at_load=True,
        tier="fallback",
    ),
    Strategy("fsdp1", "FSDP1", "fsdp1"),
    Strategy(
        "zero3_offload",
        "ZeRO-3 offload",
        "deepspeed",
        in_planner=True,
        deepspeed=True,
        bf16_weights=True,
        shards=(True, True, True),
        buffers="gathered",
        partitions_at_load=True,
        offload=True,
        tier="last",
        runs=False,
    ),
)
STRATEGY: dict[str, Strategy] = {s.name: s for s in _TABLE}
PLANNER_ROWS: tuple[Strategy, ...] = tuple(s for s in _TABLE if s.in_planner)  # ddp fsdp2 zero1/2/3 zero3_offload


def strategy_of(name: str | Strategy) -> Strategy:
    """The table's entry for a name (a Strategy passes through); KeyError for an unknown name."""
    return name if isinstance(name, Strategy) else STRATEGY[name]


def checkpoint_layout(name: str | None) -> str | None:
    """The checkpoint family of a strategy named in a trainer_state.json (None: unknown or absent)."""
    entry = STRATEGY.get(name) if isinstance(name, str) else None
    return entry.layout if entry is not None else None


def resolve_strategy(accelerator) -> Strategy:
    """The strategy actually in effect (single | ddp | fsdp2 | fsdp1 | zero1 | zero2 | zero3), from the Accelerator."""
    dt = accelerator.distributed_type
    if dt == DistributedType.DEEPSPEED:
        return STRATEGY[f"zero{accelerator.state.deepspeed_plugin.zero_stage}"]
    if dt == DistributedType.FSDP:
        return STRATEGY["fsdp2" if accelerator.is_fsdp2 else "fsdp1"]
    return STRATEGY["ddp" if accelerator.num_processes > 1 else "single"]


def fsdp2_wrap_classes(model) -> None:
    """Accelerate's FSDP2 makes one unit per class in model._no_split_modules and then another for the input
    embedding; when such a class contains the embedding (BERT's BertEmbeddings) the second `fully_shard` fails
    on an already sharded weight ("value was None when it should not be"). Drop those classes: the embedding
    still gets a unit of its own. Classes the model does not hold are dropped too (Accelerate raises "Could not find
    the transformer layer class"): a multimodal wrapper lists its towers' classes, e.g. LLaVA's CLIPTextEmbeddings of
    a CLIP text model it does not have."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    names = getattr(model, "_no_split_modules", None)
    if names:
        present = {type(m).__name__ for m in model.modules()}
        if not set(names) <= present:
            model._no_split_modules = names = [n for n in names if n in present]
    if emb is None or not names:
        return
    holders = {type(m).__name__ for m in model.modules() if m is not emb and any(c is emb for c in m.modules())}
    if holders & set(names):
        model._no_split_modules = [n for n in names if n not in holders]
