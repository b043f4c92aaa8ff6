"""Whether pipeline stages compute the unsplit model, decided by what the model does, on its tiny copy.

    why = stage_problem(config)          # None, or one line: where the stages part from the unsplit model

A stage runs the HF model's own forward over its layers; what passes between stages is the hidden state after a
layer. That is the unsplit computation only where the base model's forward is a plain chain of its layers: Gemma-3n
feeds each layer its own slice of per-layer inputs computed from the token ids (which later stages do not have) and
stacks four streams of hidden states; models whose layers hand anything else along are the same kind of case. Before
this check, stages cut several families wrongly without an error (a final norm named `final_layernorm`, `norm_f` or
LFM2's `embedding_norm` applied on every stage: Phi, GPT-NeoX, Persimmon, Nemotron-H, LFM2 / LFM2-MoE / LFM3,
ModernBERT-decoder; nanochat's norm, run before the layers and after them, removed from the first stage).

The check: the run's tiny float64 copy (hfpar.parallel.tiny_copy: its first layers, every kind of layer it has),
one stage per layer (every boundary a stage boundary), composed in one process, against the unsplit copy on the same
ids: logits, the states after each layer, and every parameter's gradient of a random cotangent, within 1e-10 relative
(1e-5 for a family that runs float32 only). The first difference is named (the layer after which the states handed on
differ, or the parameter). A model whose copy cannot be built or run is refused with the reason (as context
parallelism's check does). Milliseconds to a second, once per config.
"""

from __future__ import annotations

import copy
from functools import partial

import torch
from torch import nn

from ..tiny_copy import check_once, runnable
from .boundary import _base, _ids, decoder_layers, post_layer_children

__all__ = ["stage_problem"]


def stage_problem(config, stage_cls) -> str | None:
    """None when stages (stage_cls: PipelineStage, which calls this) cut at every layer of `config`'s tiny copy
    compute the unsplit copy (forward and backward), else why not, in one line."""
    with torch.enable_grad():  # whatever the caller's mode (a stage built under no_grad): the check runs backward
        return check_once("pp_stages", config, partial(_stages, stage_cls=stage_cls))


def _stages(model: nn.Module, stage_cls) -> str | None:
    model = runnable(model)  # float32 where the family cannot run float64 (the shared copy left float64)
    tol = 1e-10 if next(model.parameters()).dtype == torch.float64 else 1e-5
    ids = _ids(model)
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    try:
        n = len(decoder_layers(model))
    except ValueError as e:  # no layer list to cut: its own one-line reason
        return str(e).removeprefix("pipeline parallelism: ")
    post = post_layer_children(model)
    bounds = list(range(n + 1))
    stages = [stage_cls(copy.deepcopy(model), s, bounds, post_layer=post, check=False) for s in range(n)]
    after: list[torch.Tensor] = []  # the unsplit model's states after each layer
    hooks = [
        layer.register_forward_hook(lambda m, a, out: after.append(out if torch.is_tensor(out) else out[0]))
        for layer in _base(model).layers
    ]
    try:
        ref = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    finally:
        for h in hooks:
            h.remove()
    cot = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=ref.dtype)
    (ref * cot).sum().backward()
    x, sent = ids, []
    try:
        for stage in stages:
            x = stage(x, position_ids=pos)
            sent.append(x)
        (x * cot).sum().backward()
    except Exception as e:  # noqa: BLE001 - a stage that cannot run alone
        return f"the stage of layer {len(sent)} does not run alone ({type(e).__name__}: {_first_line(e)})"
    for k, (got, want) in enumerate(zip(sent[:-1], after)):
        if (err := _rel(got, want)) > tol:
            return f"the states a stage hands on after layer {k} differ from the unsplit model's by {err:.2g}"
    if (err := _rel(x, ref)) > tol:
        return f"the last stage's logits differ from the unsplit model's by {err:.2g}"
    full = _base(model).layers
    for s, stage in enumerate(stages):
        mine = _base(stage.lm).layers[0]
        for (name, p), (_, q) in zip(mine.named_parameters(), full[s].named_parameters()):
            if (err := _rel(p.grad, q.grad)) > tol:
                return f"the gradient of layer {s}'s {name} differs from the unsplit model's by {err:.2g}"
    return None


def _rel(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    if a.shape != b.shape:
        return float("inf")
    return (a.double() - b.double()).abs().max().item() / max(b.abs().max().item(), 1e-12)


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0][:160] if str(e) else ""
