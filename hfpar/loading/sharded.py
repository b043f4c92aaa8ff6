"""Sharded loading of a pretrained checkpoint (safetensors, or zip-format *.bin): each rank reads only the slices
it will hold.

    index = checkpoint_index(resolve_checkpoint("path/or/hub-id"))    # {tensor name: file}, None: neither format
    model = build_skeleton(cls, path, index)    # parameters on meta (missing keys initialised), buffers computed
    model, _ = parallelize(model, args, ctx, plan)   # LoRA (adapters drawn on CPU as usual), TP / EP,
                                                # pipeline stage split: all on meta
    load_sharded(model, index)                  # this rank's TP rows / columns (each packed part), its experts, its
                                                # stage's layers, everything else whole; = from_pretrained + same
    # plain FSDP2 (LoRA too): Accelerate's fully_shard on the meta skeleton, then fsdp2_loader(index) reads each
    # rank's dim-0 shard of every DTensor (hfpar.backends.accelerate_dp)

Files and formats: hfpar.loading.files (mmap reads of a box of a tensor). Names: hfpar.loading.views (a pipeline
stage's layers -> global names, PEFT's base layers, the last stage's tied LM head -> the embedding's key).
--upcycle_experts under TP / EP: each rank builds only its experts from the dense MLPs (hfpar.loading.upcycle).
Still loaded whole by from_pretrained (loading_mode says why): --upcycle_experts without TP / EP, generic MoE
blocks under model / pipeline parallelism, ZeRO-3 (partitioned as it loads) and DDP / ZeRO-1/2 without model
parallelism (every rank holds the whole model).

Reused (why: docs/architecture.md#why-loading-data-and-the-planner): accelerate's
`init_empty_weights(include_buffers=False)` (non-persistent buffers such as rotary inv_freq are computed as at
from_config), transformers' checkpoint conversion mapping (key renames; its MergeModulelist / Concatenate ops, fed
only this rank's experts) and `initialize_weights` for keys the checkpoint lacks (before any sharding, so a missing
key is initialised whole and sharded like a loaded one; same distribution as from_pretrained, not the same draws).
"""

from __future__ import annotations

import os
import re
from collections import defaultdict

import torch
import torch.nn as nn
from accelerate import init_empty_weights
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from transformers import AutoConfig
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import MergeModulelist, WeightConverter, WeightRenaming, rename_source_key

from hfpar.loading.files import Files, checkpoint_index, read
from hfpar.loading.upcycle import load_upcycled_experts
from hfpar.loading.views import hf_view
from hfpar.parallel.comm import group_rank
from hfpar.parallel.expert_parallel.families import MOE_FAMILIES, config_num_experts
from hfpar.parallel.sharding import set_shard_spec, shard_spec, tensor_names

__all__ = [
    "resolve_checkpoint",
    "checkpoint_index",
    "build_skeleton",
    "load_sharded",
    "fsdp2_loader",
    "is_meta",
    "loading_mode",
]


def loading_mode(args, ctx, config) -> tuple[str, str]:
    """How a pretrained checkpoint is loaded: ("sharded", why) TP / EP slices / the pipeline stage read on each
    rank before the wrap, (ctx.strategy.wrap_load, why) each rank's dim-0 shards read during the wrap ("fsdp2"),
    or ("full", why) from_pretrained. LoRA follows the base model's mode (its adapters are drawn whole, as with
    from_pretrained). The strategy's part comes from its attributes (hfpar.backends.strategies)."""
    if not args.sharded_loading:
        return "full", "--sharded_loading false"
    sliced = ctx.tp > 1 or ctx.ep > 1  # each rank holds TP / EP slices of some weights
    if args.upcycle_experts and not sliced:
        return "full", "--upcycle_experts without TP / EP: the experts are built from the whole loaded model"
    if (sliced or ctx.pp > 1) and config_num_experts(config) is not None:
        if config.model_type not in MOE_FAMILIES:  # generic / HF MoE blocks are checked with real weights
            return "full", f"MoE model_type {config.model_type!r} is detected generically (probed with its weights)"
    if ctx.pp > 1:  # any strategy: the stage is read, then wrapped (FSDP2: about 1/pp read whole, then sharded)
        return "sharded", f"each rank reads only its pipeline stage's tensors{' (its TP slices)' if ctx.tp > 1 else ''}"
    if sliced:
        return "sharded", "each rank reads its TP / EP slices" + (
            " (its upcycled experts: copies of the dense MLPs)" if args.upcycle_experts else ""
        )
    strategy = ctx.strategy
    if strategy.wrap_load:
        return strategy.wrap_load, f"each rank reads its {strategy.label} dim-0 shards"
    if strategy.partitions_at_load:
        return "full", "from_pretrained under DeepSpeed's zero.Init (partitioned as it loads)"
    return "full", f"{strategy}: every rank holds the whole model"


def resolve_checkpoint(name_or_path: str) -> str | None:
    """A local directory holding the checkpoint: the path itself, or a hub id's snapshot in the HF cache (fetched
    like from_pretrained would: *.json / *.safetensors, or *.bin where the repo has no safetensors). None when
    that fails (from_pretrained decides)."""
    if os.path.isdir(name_or_path):
        return name_or_path
    try:
        from huggingface_hub import snapshot_download  # noqa: PLC0415  (hub ids only)

        path = snapshot_download(name_or_path, allow_patterns=["*.json", "*.safetensors"])
        if checkpoint_index(path) is None:
            path = snapshot_download(name_or_path, allow_patterns=["*.json", "pytorch_model*.bin"])
        return path
    except Exception:  # noqa: BLE001 - not a hub repo, offline, gated: the full from_pretrained path reports it
        return None


def is_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


# ----------------------------------------------------------------------------- checkpoint keys -> model tensors
def _conversion_mapping(model: nn.Module) -> list:
    """transformers' conversion mapping of `model`, which it looks up per sub-model by class name first: FSDP2's
    wrapper subclasses (FSDP<Name>) are looked up as the class they wrap (LLaVA's key renames are its class's)."""
    wrapped = []
    for m in model.modules():
        cls = type(m)
        base = next((b for b in cls.__bases__ if f"FSDP{b.__name__}" == cls.__name__), None)
        if base is not None:
            wrapped.append((m, cls))
            m.__class__ = base
    try:
        return get_model_conversion_mapping(model)
    finally:
        for m, cls in wrapped:
            m.__class__ = cls


class _Sources:
    """For each model state-dict name: the checkpoint key that holds it, or (converter, {pattern: [(index, key)]})
    when transformers' conversion mapping builds it from several keys (per-expert weights -> 3-D experts)."""

    def __init__(self, model: nn.Module, index: dict[str, str], names: dict | None = None):
        mapping = _conversion_mapping(model)
        renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        # name -> tensor: transformers adds / strips base_model_prefix (a BertModel checkpoint into a
        # BertForSequenceClassification) only where the name maps to a tensor (a None value reads as absent)
        names = model.state_dict(keep_vars=True) if names is None else names  # or a view's (hf_view)
        prefix = getattr(model, "base_model_prefix", None)
        self.direct: dict[str, str] = {}
        self.converted: dict[str, tuple] = {}
        for key in index:
            target, pattern = rename_source_key(key, renamings, converters, prefix, names)
            if target not in names and key in names:  # as transformers: a key the model has is not renamed
                target, pattern = key, None
            if target not in names:
                continue  # unexpected (from_pretrained ignores them too)
            if pattern is None:
                self.direct[target] = key
                continue
            renamed = key
            for r in renamings:
                renamed, _ = r.rename_source_key(renamed)
            star = re.escape(pattern).replace(r"\*", r"(\d+)")
            m = re.search(star, renamed)
            conv, lists = self.converted.setdefault(target, (by_pattern[pattern], defaultdict(list)))
            lists[pattern].append((int(m.group(1)) if m and m.groups() else 0, key))

    def has(self, name: str) -> bool:
        return name in self.direct or name in self.converted


def _boxes(t: torch.Tensor, shape: list[int]) -> list[list[tuple[int, int]]]:
    """What this rank holds of the full tensor `shape`, as boxes concatenated along one dim (in order):
    a TP / EP ShardSpec (each packed part's rows or columns), an FSDP2 DTensor's local shard, or all of it."""
    spec = shard_spec(t)
    if isinstance(t, DTensor):
        local, offset = compute_local_shape_and_global_offset(shape, t.device_mesh, t.placements)
        return [[(o, o + n) for o, n in zip(offset, local)]]
    if spec is None or not spec.sharded:
        return [[(0, n) for n in shape]]
    d, rank, start, boxes = spec.dim, group_rank(spec.group), 0, []
    for part in spec.packed_splits or [shape[d]]:
        n = part // spec.size
        boxes.append([(0, s) for s in shape[:d]] + [(start + rank * n, start + (rank + 1) * n)])
        start += part
    return boxes


def _converted(files: Files, conv: WeightConverter, lists: dict, boxes, model) -> torch.Tensor:
    """Run transformers' converter ops on the source tensors this rank needs: with a first MergeModulelist(dim=0)
    (per-expert keys stacked into the experts dim), only the experts inside the boxes' dim-0 range are read."""
    lo, hi = min(b[0][0] for b in boxes), max(b[0][1] for b in boxes)
    by_index = isinstance(conv.operations[0], MergeModulelist) and conv.operations[0].dim == 0
    keep = (lambda i: lo <= i < hi) if by_index else (lambda i: True)
    tensors = {
        p: [read(files, k, None) for i, k in sorted(lists[p]) if keep(i)] for p in conv.source_patterns if p in lists
    }
    for k in (k for lst in lists.values() for i, k in lst if not keep(i)):
        files.done(k)  # other ranks' experts: never read here
    for op in conv.operations:
        tensors = op.convert(
            tensors,
            source_patterns=conv.source_patterns,
            target_patterns=conv.target_patterns,
            full_layer_name="",
            model=model,
            config=model.config,
            missing_keys=None,
        )
    full = next(iter(tensors.values()))
    if by_index:
        boxes = [[(a - lo, b - lo), *rest] for (a, b), *rest in boxes]
    return torch.cat([full[tuple(slice(a, b) for a, b in box)] for box in boxes], dim=_cat_dim(boxes))


def _cat_dim(boxes) -> int:
    return len(boxes[0]) - 1 if len(boxes) > 1 else 0


def _load_tensor(files: Files, sources: _Sources, names: list[str], t: torch.Tensor, model) -> torch.Tensor:
    name = next((n for n in names if sources.has(n)), None)
    if name is None:
        raise ValueError(f"sharded loading: no checkpoint tensor holds {' or '.join(names)} (the model's parameter)")
    if isinstance(t, DTensor):  # FSDP2: a DTensor's shape is the full one
        shape = list(t.shape)
    else:
        spec = shard_spec(t)
        shape = list(t.shape)
        if spec is not None and spec.sharded:  # the full tensor's shape, from the local one
            shape[spec.dim] *= spec.size
    boxes = _boxes(t, shape)
    if name in sources.direct:
        key = sources.direct[name]
        files.expect(key, len(boxes) - 1)
        parts = [read(files, key, box) for box in boxes]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=_cat_dim(boxes))
    else:
        out = _converted(files, *sources.converted[name], boxes, model)
    return out.to(t.dtype).contiguous()


def _keys_needed(sources: _Sources, names: list[str]) -> list[str]:
    keys = []
    for n in names:
        if n in sources.direct:
            keys.append(sources.direct[n])
        elif n in sources.converted:
            keys += [k for lst in sources.converted[n][1].values() for _, k in lst]
    return keys


# ----------------------------------------------------------------------------- skeleton, missing keys
def build_skeleton(
    cls,
    path: str,
    index: dict[str, str],
    dtype=torch.float32,
    config_updates: dict | None = None,
    trust_remote_code: bool = False,
    **kwargs,
) -> nn.Module:
    """cls.from_config on meta (buffers computed on CPU), in eval mode like from_pretrained; parameters the
    checkpoint lacks are initialised whole on CPU now by the model's own initialize_weights (a classification
    head on a causal-LM checkpoint), so sharding treats them like loaded ones."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    for k, v in (config_updates or {}).items():
        setattr(config, k, v)
    with init_empty_weights(include_buffers=False):
        model = cls.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code, **kwargs)
    # init_empty_weights re-creates every Parameter registered under it, the tied lm_head's included: tie again
    model.tie_weights()
    model.eval()
    sources = _Sources(model, index)
    tensors = tensor_names(model)
    missing = [(t, names) for t, names in tensors.values() if not any(sources.has(n) for n in names)]
    if missing:
        for t, _ in tensors.values():
            t._is_hf_initialized = True  # transformers' init functions skip flagged tensors
        for t, names in missing:
            _assign(model, names, torch.empty(t.shape, dtype=t.dtype), t)
        for mod in model.modules():
            mod._is_hf_initialized = False
        model.initialize_weights()
    model.hfpar_missing_keys = sorted(n for _, names in missing for n in names)
    return model


def _assign(model: nn.Module, names: list[str], value: torch.Tensor, old: torch.Tensor) -> None:
    """Put `value` in every slot that held `old` (tied weights stay one Parameter), keeping its ShardSpec."""
    new = nn.Parameter(value, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else value
    if shard_spec(old) is not None:
        set_shard_spec(new, shard_spec(old))
    for name in names:
        owner, _, leaf = name.rpartition(".")
        mod = model.get_submodule(owner) if owner else model
        if leaf in mod._parameters:
            mod._parameters[leaf] = new
        else:
            mod._buffers[leaf] = new


# ----------------------------------------------------------------------------- load
@torch.no_grad()
def load_sharded(model: nn.Module, index: dict[str, str]) -> dict:
    """Materialise every meta tensor of `model` (after TP / EP / LoRA / the pipeline stage split, before the
    data-parallel wrap) with this rank's slice read from the checkpoint files; names through hf_view (a stage's
    layers, PEFT's base layers). Returns {"tensors": n, "bytes_read": b} (this rank's)."""
    upcycled = load_upcycled_experts(model, index)  # --upcycle_experts: this rank's experts from the dense MLPs
    hf, hf_name = hf_view(model)
    tensors = tensor_names(model)
    full = {n: hf_name(n) for t, names in tensors.values() for n in names}  # this model's name -> the HF model's
    sources = _Sources(hf, index, {full[n]: t for t, names in tensors.values() for n in names})
    todo = [(t, names) for t, names in tensors.values() if t.is_meta]
    lost = [full[names[0]] for t, names in todo if not any(sources.has(full[n]) for n in names)]
    if lost:
        raise ValueError(
            f"load_sharded: the checkpoint has no tensor for {', '.join(lost[:5])}"
            f"{' ...' if len(lost) > 5 else ''} (parameters built after loading must be initialised)"
        )
    todo = [(t, sorted(names, key=lambda n: not sources.has(full[n]))) for t, names in todo]  # sourced name first
    files = Files(index, _keys_needed(sources, [full[names[0]] for _, names in todo]))
    done = upcycled
    for t, names in todo:
        value = _load_tensor(files, sources, [full[n] for n in names], t, hf)
        done += value.numel() * value.element_size()
        _assign(model, names, value, t)
    return {"tensors": len(todo), "bytes_read": done}


def _like_skeleton(local: torch.Tensor, t: DTensor) -> torch.Tensor:
    """The loaded shard in the skeleton's tensor subclass, if it has one: torchao's fp8 all-gather weight
    (mixed_precision fp8, tensorwise), which assign=True would otherwise replace by a plain tensor (FSDP2 would then
    all-gather it in bf16). Rebuilt through the subclass protocol (__tensor_flatten__ / __tensor_unflatten__)."""
    inner = t.to_local()
    if not is_traceable_wrapper_subclass(inner):
        return local
    (name, *_), meta = inner.__tensor_flatten__()
    return type(inner).__tensor_unflatten__({name: local}, meta, local.shape, local.stride())


def fsdp2_loader(index: dict[str, str]):
    """A stand-in for accelerate's fsdp2_load_full_state_dict(accelerator, model, full_sd, cpu_offload): each
    rank reads its own shard of every DTensor from the files (no rank holds the full model, no broadcast).
    Entries of full_sd that are real tensors (keys the checkpoint lacks, initialised by build_skeleton) are
    sliced locally; every rank initialised them identically (same seed)."""

    @torch.no_grad()
    def load(accelerator, model, full_sd, cpu_offload=False):  # noqa: ARG001 - accelerate's signature
        hf, hf_name = hf_view(model)  # a PEFT model (LoRA): its base layers' names
        sharded = model.state_dict()
        names = {n: hf_name(n) for n in sharded}
        # a tied weight (the LM head of a model that ties it to the embedding) is one tensor under two names, of which
        # the checkpoint holds one: each name may be read from any of them (accelerate ties them again after loading)
        aliases = {}
        for _, held in tensor_names(model).values():
            for n in held:
                aliases[n] = [names[n], *(names[a] for a in held if a != n)]
        sources = _Sources(hf, index, {names[n]: t for n, t in sharded.items()})
        files = Files(index, _keys_needed(sources, [names[n] for n in sharded if sources.has(names[n])]))
        out = {}
        for name, t in sharded.items():
            full = full_sd.get(name)
            if full is not None and not full.is_meta:
                box = _boxes(t, list(t.shape))[0]
                local = full[tuple(slice(a, b) for a, b in box)].to(t.dtype).contiguous()
            else:
                local = _load_tensor(files, sources, aliases[name], t, hf)
            local = _like_skeleton(local.to(accelerator.device if not cpu_offload else "cpu"), t)
            out[name] = DTensor.from_local(
                local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
            )
        model.load_state_dict(out, assign=True)
        return model

    return load
