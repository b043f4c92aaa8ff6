"""One pipeline stage of any HF decoder-only causal LM whose base model holds a `layers` ModuleList.

    bounds = balanced_split(model, pp)                          # [0, 2, 4]: stage s runs layers bounds[s]:bounds[s+1]
    stage = PipelineStage(model, stage_index=s, bounds=bounds)   # the model trimmed in place to its stage
    out = stage(x, position_ids=pos, attention_mask=mask)        # x: input ids (first stage) or hidden states
                                                                 # out: hidden states, or logits (last stage)

Every stage runs the HF model's own forward, so its own semantics stay: rotary embeddings recomputed from the
position ids on each stage, masks built by transformers on each stage (packed rows from the position ids, padding
from attention_mask), the last stage's final norm, LM head and any logit soft-capping. Stages after the first
hand the received hidden states to their first layer through a forward pre-hook, so what the base model does
between embedding and first layer (Gemma's sqrt(hidden) scaling) happens once, on the first stage; stages before
the last hand on their last layer's output itself (a forward hook), so what the base model does after its layers
happens once, on the last. Layers of other stages, the embedding (not first) and what runs after the layers (not
last: the final norm by whatever name, boundary.post_layer_modules) are dropped from the stage. A model whose
stages would not compute it (check.py, on its tiny copy) is refused in one line at construction.
"""

from __future__ import annotations

import contextlib
import re

import torch
import torch.distributed as dist
import torch.nn as nn

from hfpar.parallel.expert_parallel import (
    MoELayer,
    is_upcycled,
    save_upcycled_pretrained,
    upcycle_to_moe,
)
from hfpar.parallel.sharding import local_tensor

from .boundary import _base, decoder_layers, drop_post_layer, post_layer_modules, stage_config
from .check import stage_problem


def tied_embedding_group(pipelines: list[list[int]]):
    """Collective (every rank, the same pipelines in the same order): one process group per pipeline joining its
    first and last stage, for tied embeddings; returns this rank's group, or None."""
    mine, rank = None, dist.get_rank()
    for peers in pipelines:
        group = dist.new_group([peers[0], peers[-1]])
        if rank in (peers[0], peers[-1]):
            mine = group
    return mine


def _numel(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def balanced_split(model: nn.Module, pp: int) -> list[int]:
    """Stage boundaries [0, b1, .., L] minimizing the largest stage's parameter count, the embedding counted on
    the first stage and the final norm + LM head on the last (contiguous layers, every stage non-empty)."""
    layers = decoder_layers(model)
    n = len(layers)
    if pp > n:
        raise ValueError(f"--pp_size {pp}: {type(model).__name__} has {n} decoder layers, fewer than the stages")
    cost = [float(_numel(layer)) for layer in layers]
    cost[0] += _numel(model.get_input_embeddings())
    cost[-1] += _numel(model.lm_head) + _numel(getattr(_base(model), "norm", None))
    return split_by_cost(cost, pp)


def split_by_cost(cost: list[float], pp: int) -> list[int]:
    """Boundaries [0, b1, .., n] of n = len(cost) items cut into pp contiguous non-empty parts, minimizing the
    largest part's cost (also hfpar plan's, from parameter counts)."""
    n = len(cost)
    prefix = [0.0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    # best[k][j]: the smallest max-stage cost splitting layers [0, j) into k stages; exact dynamic programme
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(pp + 1)]
    cut = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = 0.0
    for k in range(1, pp + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                v = max(best[k - 1][i], prefix[j] - prefix[i])
                if v < best[k][j]:
                    best[k][j], cut[k][j] = v, i
    bounds, j = [n], n
    for k in range(pp, 0, -1):
        j = cut[k][j]
        bounds.append(j)
    return bounds[::-1]


def parse_split(text: str, num_layers: int, pp: int) -> list[int]:
    """--pp_split "0,10,20": the first layer of each stage -> boundaries [0, 10, 20, L]; ValueError in one line."""
    try:
        starts = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(
            f"--pp_split {text!r}: expected {pp} comma-separated layer indices, e.g. "
            f"{','.join(str(i * num_layers // pp) for i in range(pp))}"
        ) from None
    bounds = starts + [num_layers]
    if len(starts) != pp or starts[0] != 0 or any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(
            f"--pp_split {text!r}: needs {pp} increasing first-layer indices starting at 0 and below "
            f"{num_layers} (every stage non-empty), e.g. {','.join(str(i * num_layers // pp) for i in range(pp))}"
        )
    return bounds


def pipeline_problem(config) -> str | None:
    """Why pipeline stages would not compute `config`'s model (one line), or None: check.stage_problem on its tiny
    copy, cut at every layer (cached per config). The recipes' preflight asks it before the model loads."""
    return stage_problem(config, PipelineStage)


class PipelineStage(nn.Module):
    """The stage `stage_index` of `model` (trimmed in place; keep no other reference to the full model)."""

    def __init__(
        self,
        model: nn.Module,
        stage_index: int,
        bounds: list[int],
        peft_model: nn.Module | None = None,
        post_layer: tuple[str, ...] | None = None,
        check: bool = True,
    ):
        """post_layer: the base model's children that run after its layers (post_layer_children; None: found on the
        model's tiny copy, post_layer_modules), dropped from every stage but the last. check: refuse (ValueError, one
        line) a model whose stages would not compute it (check.stage_problem on its tiny copy; cached per config)."""
        super().__init__()
        if check and (why := stage_problem(model.config, PipelineStage)):
            raise ValueError(f"pipeline parallelism: {type(model).__name__}'s stages would not compute it: {why}")
        layers = decoder_layers(model)
        self.stage_index, self.num_stages = stage_index, len(bounds) - 1
        self.start, self.stop = bounds[stage_index], bounds[stage_index + 1]
        self.num_layers = len(layers)
        self.is_first, self.is_last = stage_index == 0, stage_index == self.num_stages - 1
        self.full_config = model.config
        base = _base(model)
        # tied input / output embeddings: the first stage keeps the weight as its embedding, the last as its LM head
        # (each a copy, equal at load); their grads are summed over the two (tied_embedding_group) before the step
        self.ties_embeddings = (
            self.num_stages > 1
            and model.get_output_embeddings() is not None
            and model.get_output_embeddings().weight is model.get_input_embeddings().weight
        )
        self._holds_tied = self.ties_embeddings and (self.is_first or self.is_last)
        post = post_layer_modules(model.config) if post_layer is None else post_layer
        base.layers = nn.ModuleList(list(layers)[self.start : self.stop])
        base.config = stage_config(base.config, len(layers), self.start, self.stop)
        if not self.is_first:
            base.embed_tokens = None
        if not self.is_last:
            drop_post_layer(base, post)
            model.lm_head = None
        self.lm = model
        self._received = None
        self._peft = [peft_model] if peft_model is not None else []  # a list: not a registered submodule
        self._hook = None
        if not self.is_first:
            self.hook_first_layer()

    @property
    def peft_model(self):
        """The PEFT model (LoRA) whose base model this stage trims, or None."""
        return self._peft[0] if self._peft else None

    def hook_first_layer(self) -> None:
        """(Re)register the pre-hook feeding the received hidden states to the first layer, ahead of any other
        pre-hook: a data-parallel wrapper (FSDP2) registered later must see those states, not the placeholder
        inputs, to hang its backward hooks on them."""
        if self._hook is not None:
            self._hook.remove()
        self._hook = (
            _base(self.lm).layers[0].register_forward_pre_hook(self._take_received, with_kwargs=True, prepend=True)
        )

    def get_output_embeddings(self) -> nn.Module | None:
        """The LM head (last stage; vocab-parallel under TP, which selects the loss), else None."""
        return self.lm.get_output_embeddings() if self.is_last else None

    def _take_received(self, module, args, kwargs):
        """First layer of a later stage: its hidden states are the ones received from the previous stage."""
        if args:
            return (self._received, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": self._received}

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        seq_len: int | None = None,
    ) -> torch.Tensor:
        """seq_len: the micro-batch's full length T. Under sequence parallelism the received states are this TP
        rank's part of the sequence (B, T/tp, H); the base model then gets a stand-in of the full shape, so that
        its masks and cache positions cover T (the first layer takes the received part through the pre-hook)."""
        kw = dict(position_ids=position_ids, attention_mask=attention_mask, use_cache=False)
        inputs = {"input_ids": x} if self.is_first else {"inputs_embeds": x}
        if not self.is_first and seq_len is not None and x.shape[1] != seq_len:
            inputs["inputs_embeds"] = x.new_zeros(()).expand(x.shape[0], seq_len, *x.shape[2:])
        self._received = None if self.is_first else x
        if self.is_last:
            return self.lm(**inputs, **kw).logits
        # what the base model does after its layers (a final norm by any name, LFM2's `embedding_norm`) belongs to
        # the last stage: the states handed on are the last layer's output itself, taken by a hook
        sent: list = []
        handle = _base(self.lm).layers[-1].register_forward_hook(lambda mod, args, out: sent.append(out))
        try:
            _base(self.lm)(**inputs, **kw)
        finally:
            handle.remove()
        out = sent[-1]
        return out if isinstance(out, torch.Tensor) else out[0]

    @contextlib.contextmanager
    def receiving(self, x: torch.Tensor | None):
        """Around the backward of a micro-batch whose forward was not the last one: activation checkpointing
        recomputes the first layer there, and its pre-hook must see that micro-batch's received states."""
        previous, self._received = self._received, x
        try:
            yield
        finally:
            self._received = previous

    @property
    def tied(self) -> nn.Parameter | None:
        """The tied embedding weight this stage holds (first: embedding, last: LM head), or None. Looked up each
        time: a data-parallel wrapper (FSDP2) replaces the Parameter objects."""
        if not self._holds_tied:
            return None
        return (self.lm.get_input_embeddings() if self.is_first else self.lm.lm_head).weight

    def sync_tied_grads(self, group) -> None:
        """Collective over `group` (tied_embedding_group; first and last stage only): the tied embedding's grad
        becomes the sum of its embedding and LM-head parts, as in the unsplit model."""
        if self.tied is None:
            return
        tied = self.tied
        if tied.grad is None:
            tied.grad = torch.zeros_like(tied)
        dist.all_reduce(local_tensor(tied.grad), group=group)  # FSDP2: both ends hold the same dp shard of it

    def full_model(self) -> nn.Module:
        """The full model this stage was cut from, built on the meta device (no memory) from the full config, its
        MLPs upcycled as this stage's were (upcycle_to_moe: then exported as the HF MoE architecture it became)."""
        with torch.device("meta"):
            full = type(self.lm)(self.full_config)
        moe = next((m for m in self.lm.modules() if isinstance(m, MoELayer)), None)
        if moe is not None and is_upcycled(self.lm):
            g = moe.gate
            upcycle_to_moe(full, g.num_experts, g.top_k, aux_loss_coef=g.aux_loss_coef, z_loss_coef=g.z_loss_coef)
        return full

    def save_pretrained(self, save_directory, state_dict: dict, **kwargs) -> None:
        """Write the full model in HF format from the merged state dict of every stage: saved through full_model(),
        so config, generation config and file layout are exactly what `from_pretrained` expects."""
        full = self.full_model()
        if is_upcycled(full):
            save_upcycled_pretrained(full, save_directory, state_dict=state_dict, is_main_process=True, **kwargs)
        else:
            full.save_pretrained(save_directory, state_dict=state_dict, **kwargs)

    def hf_name(self, name: str) -> str:
        """A state-dict name of this stage -> the full model's name (layer indices made global)."""
        name = name[len("lm.") :] if name.startswith("lm.") else name
        if self.peft_model is not None:  # the PEFT model's names: its LoRA model wraps the trimmed base model
            name = "base_model.model." + name
        return re.sub(
            r"(^|\.)layers\.(\d+)\.", lambda m: f"{m.group(1)}layers.{int(m.group(2)) + self.start}.", name, count=1
        )
