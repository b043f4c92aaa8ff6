"""Tensor-parallel plans proposed from a model's module structure, for families with neither a written plan
(plans.py) nor a config.base_model_tp_plan (derived.py): OPT, BioGPT, GPT-BigCode, StableLM, Persimmon, ...

    plans = infer_plans(model)     # candidate plans, most likely first; [] when no decoder structure is recognised

The decoder blocks are the first ModuleList of blocks holding Linears. In the first block: the attention module is
the one whose own Linears are q/k/v (separate) or one fused projection (query_key_value, c_attn, Wqkv, qkv_proj)
plus an output projection; the MLP is the module (or the block itself: OPT's fc1 / fc2) whose own Linears are an
input (fc1, c_fc, up/gate_proj, dense_h_to_4h, ...) and an output (fc2, c_proj, down_proj, dense_4h_to_h, ...)
projection. Encoders whose out-projections live in a sibling module (BERT and its copies: attention.self holds q / k /
v, attention.output.dense projects out; intermediate.dense goes up, output.dense comes down) get the module holding
the in-projections as the region and the first Linear after it that takes its width as the row-parallel layer
(_split_regions). Lists beside the block list, as long and holding Linears, are planned too (XLM / FlauBERT: attentions
in one list, MLPs in another; a list element that is the attention itself is its region). A fused projection's
layout is not visible in the structure: one candidate per layout (per-head q|k|v interleaved: plain colwise;
[q | k | v] concatenated: colwise_packed:qkv); separate q / k / v also get a last candidate with each split as two
halves (differential attention pairs head i with head i + H/2: DiffLlama).
apply_tensor_parallel keeps the first candidate that validates and passes verify_first_block (forward and backward of
the first block against the unsharded block), else refuses in one line with the last candidate's reason. The embedding
is vocab-parallel and the LM head column-parallel (vocab shards); position embeddings and norms stay replicated.
"""

from __future__ import annotations

import re
from functools import partial

from torch import nn

from ..language_model import language_model_path, text_config
from .conv1d import is_conv1d
from .heads import HEAD_COUNTS, head_count_values
from .hf_loss import computes_own_loss
from .plans import compile_pattern
from .shape_check import ATTENTION, lookup_only

__all__ = ["infer_plans", "unrecognised"]

_SPLIT = (
    ("q_proj", "k_proj", "v_proj"),
    ("query", "key", "value"),
    ("q", "k", "v"),
    ("Wq", "Wk", "Wv"),
    ("q_lin", "k_lin", "v_lin"),
    ("query_proj", "key_proj", "value_proj"),
)
_FUSED = ("query_key_value", "c_attn", "Wqkv", "qkv_proj", "qkv")
_OUT = ("o_proj", "out_proj", "dense", "c_proj", "o", "out", "Wo", "out_lin")
_UP = ("gate_proj", "up_proj", "c_fc", "fc1", "dense_h_to_4h", "w1", "w3", "fc_in", "gate_up_proj", "Wi", "lin1")
_DOWN = ("down_proj", "c_proj", "fc2", "dense_4h_to_h", "w2", "fc_out", "Wo", "lin2")


def _linears(mod: nn.Module) -> list[str]:
    """Its own Linears and Conv1Ds (GPT-1 / GPT-2 style: the same projection stored transposed)."""
    return [n for n, c in mod.named_children() if isinstance(c, nn.Linear) or is_conv1d(c)]


def _blocks(model: nn.Module) -> str | None:
    """The first ModuleList of blocks holding Linears, inside the language model (a multimodal wrapper's vision
    tower, listed first, has blocks too: they stay replicated)."""
    lm_path = language_model_path(model)
    root = model.get_submodule(lm_path) if lm_path else model
    for name, m in root.named_modules(prefix=lm_path):
        if (
            isinstance(m, nn.ModuleList)
            and len(m)
            and any(isinstance(x, nn.Linear) or is_conv1d(x) for x in m[0].modules())
        ):
            return name
    return None


def _width(m: nn.Module, out: bool) -> int | None:
    if isinstance(m, nn.Linear):
        return m.out_features if out else m.in_features
    return (m.nf if out else m.nx) if is_conv1d(m) else None


def _norms(region: nn.Module, widths: set[int], head_dim) -> list[str]:
    """Its own RMSNorms as wide as a sharded activation (a column output, the row layer's input) and not one head:
    a norm over all heads / all features (BitNet's attn_sub_norm / ffn_sub_norm) -> sharded_rmsnorm."""
    out = []
    for n, c in region.named_children():
        w = getattr(c, "weight", None)
        if (
            "RMSNorm" in type(c).__name__
            and isinstance(w, nn.Parameter)
            and w.dim() == 1
            and w.numel() in widths
            and w.numel() != head_dim
        ):
            out.append(n)
    return out


def _heads(model: nn.Module, attn: nn.Module) -> set[int]:
    cfg = text_config(getattr(model, "config", None))
    vals = {getattr(attn, a, None) for a in HEAD_COUNTS}
    vals |= head_count_values(cfg, kv=False) if cfg is not None else set()
    return {v for v in vals if isinstance(v, int) and not isinstance(v, bool) and v > 1}


def _split_names(lin: list[str]) -> tuple[str, str, str] | None:
    """The known names of separate q / k / v projections among a module's own Linears."""
    return next((s for s in _SPLIT if all(n in lin for n in s)), None)


def _qkvo_by_shape(m: nn.Module, lin: list[str]) -> tuple[str, str, str, str] | None:
    """Names of q, k, v, o told by their shapes where the names are none of the known ones (CPM-Ant's project_q /
    project_k / project_v / attention_out): exactly four own Linears, in definition order three from the same input
    (k and v alike) and a fourth from q's width back to that input's. Verified like everything inferred."""
    ls = [(n, getattr(m, n)) for n in lin if isinstance(getattr(m, n), nn.Linear)]
    if len(ls) != 4 or len(lin) != 4:
        return None
    (q, qm), (k, km), (v, vm), (o, om) = ls
    same_in = qm.in_features == km.in_features == vm.in_features == om.out_features
    if same_in and km.out_features == vm.out_features and om.in_features == qm.out_features:
        return q, k, v, o
    return None


def _attention(model: nn.Module, rel: str, m: nn.Module, lin: list[str]) -> tuple[dict[str, str], str | None] | None:
    """Relative entries of an attention module (its own q/k/v or fused projection plus an output projection), and the
    fused projection's name; None when `m` is not one. Beside q/k/v/o: an own Linear as wide as q from the same input
    (AFMoE's per-head output gate) colwise, own parameters laid out by head along dim 0 (GPT-OSS's attention sinks)
    head_param, own 1-D parameters as wide as the output (GPT-NeoX-Japanese's dense_bias) output_param, own RMSNorms
    over the whole sharded width sharded_rmsnorm. Verified like everything inferred."""
    outs = [n for n in lin if n in _OUT]
    split = _split_names(lin)
    fuse = next((n for n in _FUSED if n in lin), None)
    if not (outs and (split or fuse)) and (shaped := _qkvo_by_shape(m, lin)):
        split, outs, fuse = shaped[:3], [shaped[3]], None
    if not (outs and (split or fuse)):
        return None
    pre = f"{rel}." if rel else ""  # rel "": the block is the attention (XLM's list of attentions)
    ent = {rel: "attention"}
    for n in split or ():
        ent[f"{pre}{n}"] = "colwise"
    out = outs[0]
    ent[f"{pre}{out}"] = "rowwise"
    widths = {_width(getattr(m, out), False)}
    if split:
        q = getattr(m, split[0])
        widths |= {_width(getattr(m, n), True) for n in split}
        for n in lin:
            c = getattr(m, n)
            if (
                n not in split
                and n != out
                and _width(c, False) == _width(q, False)
                and _width(c, True) == _width(q, True)
            ):
                ent[f"{pre}{n}"] = "colwise"
    heads, model_width = _heads(model, m), _width(getattr(m, out), True)
    for n, p in m.named_parameters(recurse=False):
        if p.dim() >= 1 and p.shape[0] in heads:
            ent[f"{pre}{n}"] = "head_param"
        elif p.dim() == 1 and p.numel() == model_width:  # as wide as the output: applied after the all-reduce
            ent[f"{pre}{n}"] = "output_param"
    for n in _norms(m, widths, getattr(m, "head_dim", None)):
        ent[f"{pre}{n}"] = "sharded_rmsnorm"
    return ent, (f"{pre}{fuse}" if fuse and not split else None)


def _mlp(rel: str, m: nn.Module, lin: list[str]) -> tuple[dict[str, str], str | None] | None:
    """Relative entries of an MLP (an input and an output projection; a Sequential of exactly two Linears: CTRL's
    ffn), and its up projection when it is twice as wide as the down projection's input (a fused gate|up, layout
    unknown: ModernBERT's Wi, chunked in two); None when `m` is not one."""
    ups, downs = [n for n in lin if n in _UP], [n for n in lin if n in _DOWN]
    if isinstance(m, nn.Sequential) and len(lin) == 2 and not (ups and downs):
        ups, downs = [lin[0]], [lin[1]]
    ups = [n for n in ups if n not in downs[:1]]
    if not (ups and downs):
        return None
    pre = f"{rel}." if rel else ""
    ent = {rel: "mlp"} if rel else {}  # rel "": the block itself (OPT's fc1 / fc2), no region of its own
    ent.update({f"{pre}{n}": "colwise" for n in ups})
    down = getattr(m, downs[0])
    ent[f"{pre}{downs[0]}"] = "rowwise"
    widths = {_width(down, False)} | {_width(getattr(m, n), True) for n in ups}
    for n in _norms(m, widths, None):
        ent[f"{pre}{n}"] = "sharded_rmsnorm"
    fused = next((n for n in ups if _width(getattr(m, n), True) == 2 * _width(down, False)), None)
    return ent, (f"{pre}{fused}" if fused and len(ups) == 1 else None)


def _linears_after(block: nn.Module, rel: str) -> list[tuple[str, nn.Module]]:
    """The block's Linears / Conv1Ds that come after module `rel`'s subtree, in module (definition) order."""
    out, seen = [], False
    for n, m in block.named_modules():
        if n == rel:
            seen = True
        elif seen and not n.startswith(rel + ".") and (isinstance(m, nn.Linear) or is_conv1d(m)):
            out.append((n, m))
    return out


def _split_regions(block: nn.Module, ent: dict[str, str], attn: bool, mlp: bool) -> tuple[dict[str, str], list[str]]:
    """Entries of an encoder block whose projections out of a region live in a sibling module (BERT and its many
    copies: attention.self holds q / k / v, attention.output.dense projects out; intermediate.dense goes up,
    output.dense comes down). The region is the module holding the in-projections alone (its input feeds them only;
    BertAttention's also feeds the residual, which must not be summed over the TP ranks); the out-projection is the
    first Linear after it in the block that takes its width. Verified like everything inferred. Returns the entries and
    the attention's out-projection (outside its region: a plan that leaves the attention whole drops it too)."""
    new: dict[str, str] = {}
    outs: list[str] = []
    for rel, m in block.named_modules():
        lin = _linears(m)
        if not rel or not lin or any(rel == k or rel.startswith(k + ".") or k.startswith(rel + ".") for k in ent):
            continue
        split = _split_names(lin)
        up = getattr(m, lin[0])
        if not attn and split and len(lin) == 3:
            want, style = _width(getattr(m, split[2]), True), "attention"
            region = {f"{rel}.{n}": "colwise" for n in split}
        elif (  # an up-projection alone (and its activation): no other parameter in the region
            not mlp
            and len(lin) == 1
            and _width(up, True) > _width(up, False)
            and sum(1 for _ in m.parameters()) == sum(1 for _ in up.parameters())
        ):
            want, region, style = _width(up, True), {f"{rel}.{lin[0]}": "colwise"}, "mlp"
        else:
            continue
        out = next((n for n, c in _linears_after(block, rel) if _width(c, False) == want and n not in ent), None)
        if out is None:
            continue
        new.update({rel: style, **region, out: "rowwise"})
        outs += [out] if style == "attention" else []
        attn, mlp = attn or style == "attention", mlp or style == "mlp"
        ent = {**ent, **new}
    return new, outs


def _block_entries(model: nn.Module, block: nn.Module) -> tuple[dict[str, str], list[str], list[str], list[str]]:
    """(entries relative to the block, fused qkv names, fused gate|up names, output projections of an attention
    outside its region) of one decoder block."""
    ent: dict[str, str] = {}
    qkv: list[str] = []
    gate_up: list[str] = []
    attn = mlp = False
    for rel, m in block.named_modules():
        lin = _linears(m)
        got = _attention(model, rel, m, lin) if not attn else None
        if got and not rel and any(n not in got[0] for n in lin):  # the block itself: only if it is the attention
            got = None  # (XLM's list of attentions), else its input also feeds the rest of the block
        if got:
            attn = True
            ent.update(got[0])
            qkv += [got[1]] if got[1] else []
            continue
        got = _mlp(rel, m, lin) if not mlp else None
        if got:
            mlp = True
            ent.update(got[0])
            gate_up += [got[1]] if got[1] else []
    split, outs = _split_regions(block, ent, attn, mlp) if not (attn and mlp) else ({}, [])
    ent.update(split)
    return ent, qkv, gate_up, outs


def _sibling_lists(model: nn.Module, blocks: str) -> list[str]:
    """The block list and the lists beside it of as many modules holding Linears (XLM / FlauBERT keep their
    attentions in one list and their MLPs in another)."""
    parent = blocks.rpartition(".")[0]
    first = model.get_submodule(blocks)
    out = [blocks]
    for n, m in (model.get_submodule(parent) if parent else model).named_children():
        name = f"{parent}.{n}" if parent else n
        if (
            name != blocks
            and isinstance(m, nn.ModuleList)
            and len(m) == len(first)
            and any(isinstance(x, nn.Linear) or is_conv1d(x) for x in m[0].modules())
        ):
            out.append(name)
    return out


def infer_plans(model: nn.Module) -> list[dict[str, str]]:
    """Candidate plans (see the module docstring); [] when the structure is not recognised."""
    first = _blocks(model)
    if first is None:
        return []
    groups: dict[tuple, list[int]] = {}  # hybrid stacks: one set of entries per block structure (and list)
    for blocks in _sibling_lists(model, first):
        for i, block in enumerate(model.get_submodule(blocks)):
            ent, qkv, gate_up, outs = _block_entries(model, block)
            groups.setdefault((blocks, tuple(ent.items()), tuple(qkv), tuple(gate_up), tuple(outs)), []).append(i)
    groups = {k: v for k, v in groups.items() if k[1]}
    if not groups:
        return []

    def at_(blocks: str, idx: list[int], rel: str) -> str:
        if len(idx) == len(model.get_submodule(blocks)):
            return f"{blocks}.*.{rel}" if rel else f"{blocks}.*"
        pat = rf"re:{re.escape(blocks)}\.(?:{'|'.join(map(str, idx))})"
        return pat + (re.escape(f".{rel}") if rel else "")

    common: dict[str, str] = {}
    qkv, gate_up, split, attn_outs = [], [], [], []
    for (blocks, ent, fq, fg, outs), idx in groups.items():
        at = partial(at_, blocks)
        common.update({at(idx, r): s for r, s in ent})
        attn_outs += [at(idx, r) for r in outs]
        qkv += [at(idx, r) for r in fq]
        gate_up += [at(idx, r) for r in fg]
        regions = [r for r, s in ent if s in ATTENTION]
        split += [
            at(idx, r)
            for r, s in ent
            if s == "colwise"
            and r.rpartition(".")[0] in regions
            and r.rpartition(".")[2] in {n for t in _SPLIT for n in t}
        ]
    names = {id(m): n for n, m in model.named_modules()}
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = inp is not None and out is not None and getattr(out, "weight", None) is getattr(inp, "weight", None)
    own_loss = computes_own_loss(model)  # its loss would see vocab shards: the head stays whole
    if lookup_only(inp) and id(inp) in names and not (tied and own_loss):
        common[names[id(inp)]] = "vocab_embedding"
    if isinstance(out, nn.Linear) and id(out) in names and (lookup_only(inp) or not tied) and not own_loss:
        common[names[id(out)]] = "colwise_lm_head"
    # layouts the structure does not show, most likely first: fused q|k|v per head (plain colwise) or concatenated;
    # a fused gate|up concatenated (chunked in two halves) or interleaved
    halves = {
        p: f"colwise_packed:{_width(model.get_submodule(_first(model, p)), True) // 2},"
        f"{_width(model.get_submodule(_first(model, p)), True) // 2}"
        for p in gate_up
    }
    out_plans = []
    for q in ("colwise", "colwise_packed:qkv") if qkv else ("colwise",):
        for g in ("packed", "colwise") if gate_up else ("colwise",):
            plan = {**common, **{p: q for p in qkv}}
            plan.update({p: halves[p] if g == "packed" else "colwise" for p in gate_up})
            out_plans.append(plan)
    # differential attention (DiffLlama): head i pairs with head i + H/2 (and the values' two halves likewise), so
    # q / k / v are split as two halves, each half by rank: a rank's heads keep their partners
    paired = {
        p: f"colwise_packed:{_width(model.get_submodule(_first(model, p)), True) // 2},"
        f"{_width(model.get_submodule(_first(model, p)), True) // 2}"
        for p in split
    }
    if paired:
        out_plans.append({**out_plans[0], **paired})
    # the same with the attention modules' all-heads width attributes localized too (DBRX, XGLM: attention_widths)
    out_plans += [{p: "attention_widths" if st == "attention" else st for p, st in pl.items()} for pl in out_plans]
    # last: the attention left whole (replicated), the MLPs sharded (a hybrid stack whose attention no candidate
    # verifies: LFM's)
    attn = [p for p, st in common.items() if st in ATTENTION]
    mlp_only = {
        p: st
        for p, st in out_plans[0].items()
        if p not in attn
        and p not in attn_outs
        and not any(p.startswith(a + ".") or (a.startswith("re:") and p.startswith(a + re.escape("."))) for a in attn)
    }
    if attn and any(st == "mlp" for st in mlp_only.values()):
        out_plans.append(mlp_only)
    return out_plans


def _first(model: nn.Module, pattern: str) -> str:
    rx = compile_pattern(pattern)
    return next(n for n, _ in model.named_modules() if rx.fullmatch(n))


def unrecognised(model: nn.Module) -> str:
    """Why infer_plans found nothing, naming the first block and its modules (for the one-line refusal)."""
    blocks = _blocks(model)
    if blocks is None:
        return "no decoder blocks holding Linear layers were found to infer a plan from"
    block = model.get_submodule(f"{blocks}.0")
    kids = ", ".join(
        f"{n} ({type(m).__name__})" for n, m in block.named_children() if next(m.parameters(), None) is not None
    )
    return (
        f"{blocks}.0 has no attention (q/k/v or a fused qkv, and an output projection) or MLP (an input and an "
        f"output projection) made of its own Linears (its modules: {kids})"
    )
