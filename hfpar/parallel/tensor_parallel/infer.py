"""Tensor-parallel plans proposed from a model's module structure, for families with neither a written plan
(plans.py) nor a config.base_model_tp_plan (derived.py): OPT, BioGPT, GPT-BigCode, StableLM, Persimmon, ...

    plans = infer_plans(model)     # candidate plans, most likely first; [] when no decoder structure is recognised

The decoder blocks are the first ModuleList of blocks holding Linears. In the first block: the attention module is
the one whose own Linears are q/k/v (separate) or one fused projection (query_key_value, c_attn, Wqkv, qkv_proj)
plus an output projection; the MLP is the module (or the block itself: OPT's fc1 / fc2) whose own Linears are an
input (fc1, c_fc, up/gate_proj, dense_h_to_4h, ...) and an output (fc2, c_proj, down_proj, dense_4h_to_h, ...)
projection. A fused projection's layout is not visible in the structure: one candidate per layout (per-head q|k|v
interleaved: plain colwise; [q | k | v] concatenated: colwise_packed:qkv). apply_tensor_parallel keeps the first
candidate that validates and passes verify_first_block (forward and backward of the first block against the
unsharded block), else refuses in one line with the last candidate's reason. The embedding is vocab-parallel and
the LM head column-parallel (vocab shards); position embeddings and norms stay replicated.
"""

from __future__ import annotations

from torch import nn

from .conv1d import is_conv1d

__all__ = ["infer_plans"]

_SPLIT = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("q", "k", "v"))
_FUSED = ("query_key_value", "c_attn", "Wqkv", "qkv_proj", "qkv")
_OUT = ("o_proj", "out_proj", "dense", "c_proj", "o", "out")
_UP = ("gate_proj", "up_proj", "c_fc", "fc1", "dense_h_to_4h", "w1", "w3", "fc_in", "gate_up_proj")
_DOWN = ("down_proj", "c_proj", "fc2", "dense_4h_to_h", "w2", "fc_out")


def _linears(mod: nn.Module) -> list[str]:
    """Its own Linears and Conv1Ds (GPT-1 / GPT-2 style: the same projection stored transposed)."""
    return [n for n, c in mod.named_children() if isinstance(c, nn.Linear) or is_conv1d(c)]


def _blocks(model: nn.Module) -> str | None:
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) and any(isinstance(x, nn.Linear) or is_conv1d(x)
                                                            for x in m[0].modules()):
            return name
    return None


def infer_plans(model: nn.Module) -> list[dict[str, str]]:
    """Candidate plans (see the module docstring); [] when the structure is not recognised."""
    blocks = _blocks(model)
    if blocks is None:
        return []
    block, pat = model.get_submodule(f"{blocks}.0"), f"{blocks}.*"
    attn: dict[str, str] = {}
    fused: str | None = None
    mlp: dict[str, str] = {}
    for rel, m in block.named_modules():
        lin = _linears(m)
        where = f"{pat}.{rel}" if rel else pat
        outs = [n for n in lin if n in _OUT]
        split = next((s for s in _SPLIT if all(n in lin for n in s)), None)
        fuse = next((n for n in _FUSED if n in lin), None)
        if not attn and rel and outs and (split or fuse):
            attn[where] = "attention"
            for n in split or ():
                attn[f"{where}.{n}"] = "colwise"
            fused = f"{where}.{fuse}" if fuse and not split else None
            attn[f"{where}.{outs[0]}"] = "rowwise"
            continue
        ups, downs = [n for n in lin if n in _UP], [n for n in lin if n in _DOWN]
        if not mlp and ups and downs:
            if rel:   # a module of its own: one TP region
                mlp[where] = "mlp"
            mlp.update({f"{where}.{n}": "colwise" for n in ups})
            mlp[f"{where}.{downs[0]}"] = "rowwise"
    if not attn and not mlp:
        return []
    names = {id(m): n for n, m in model.named_modules()}
    common: dict[str, str] = {**attn, **mlp}
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(inp, nn.Embedding) and id(inp) in names:
        common[names[id(inp)]] = "vocab_embedding"
    if isinstance(out, nn.Linear) and id(out) in names:
        common[names[id(out)]] = "colwise_lm_head"
    if fused is None:
        return [common]
    return [{**common, fused: "colwise"}, {**common, fused: "colwise_packed:qkv"}]
