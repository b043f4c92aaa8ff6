"""Interleaved pipeline stages: rank r of p holds V chunks of an HF decoder's layers, virtual stages r, r + p, ..

    bounds = balanced_split(model, p * V)                 # [0, 1, 2, 3, 4]: virtual stage v runs bounds[v]:bounds[v+1]
    stage = PipelineChunks(model, rank=r, pp=p, bounds=bounds)
    stage.chunks[c](x, position_ids=pos, attention_mask=mask)   # chunk c: a PipelineStage (virtual stage c x p + r)

Each chunk is a PipelineStage built on its own shell of the model (the HF module objects, not copies, with their
own lists of children), so every chunk runs the HF forward exactly as a single stage does: the embedding on virtual
stage 0 (rank 0), the final norm and LM head on the last (rank p - 1), which are also the two holders of tied
embeddings, as with one stage per rank. The schedule (PipelineRunner, interleaved_1f1b) calls the chunks; the
backend sees the same interface as a PipelineStage (tied weight, HF names, export).
"""

from __future__ import annotations

import copy
import re

import torch
import torch.nn as nn

from .boundary import _base, drop_post_layer, post_layer_modules
from .stage import PipelineStage


def _shell(module: nn.Module) -> nn.Module:
    """A shallow copy whose children / parameters / buffers can be replaced without touching `module`."""
    new = copy.copy(module)
    new._modules, new._parameters, new._buffers = dict(module._modules), dict(module._parameters), dict(module._buffers)
    return new


def model_shell(model: nn.Module) -> nn.Module:
    """The causal LM and its base model as shells over the same layers, embedding, norm and head."""
    lm = _shell(model)
    base = _base(model)
    for name, child in model.named_children():
        if child is base:
            lm._modules[name] = _shell(base)
    return lm


def _trim(model: nn.Module, first: bool, last: bool) -> None:
    """The full model's own layer list emptied (each chunk's shell holds its layers), and the embedding / norm / head
    removed where this rank holds no first / last virtual stage: only the chunks keep parameters alive."""
    base = _base(model)
    base.layers = nn.ModuleList()
    if not first:
        base.embed_tokens = None
    if not last:
        drop_post_layer(base, post_layer_modules(model.config))  # as PipelineStage does
        model.lm_head = None


def chunk_layers(bounds: list[int], pp: int) -> list[list[list[int]]]:
    """[[[start, stop] of each chunk of rank r] for r in ranks] (run_info's pp_stage_layers when interleaved)."""
    stages = len(bounds) - 1
    return [[[bounds[v], bounds[v + 1]] for v in range(r, stages, pp)] for r in range(pp)]


class PipelineChunks(nn.Module):
    """The V = (len(bounds) - 1) / pp chunks of pipeline rank `rank` (the model trimmed; keep no other reference)."""

    def __init__(self, model: nn.Module, rank: int, pp: int, bounds: list[int], peft_model: nn.Module | None = None):
        super().__init__()
        stages = len(bounds) - 1
        if stages % pp or stages < 2 * pp:
            raise ValueError(f"interleaved pipeline: {stages} virtual stages are not a multiple >= 2 of --pp_size {pp}")
        self.chunks = nn.ModuleList(
            PipelineStage(model_shell(model), v, bounds, peft_model=peft_model) for v in range(rank, stages, pp)
        )
        self._peft = [peft_model] if peft_model is not None else []  # a list: not a registered submodule
        self.stage_index, self.num_stages = rank, pp
        self.is_first, self.is_last = self.chunks[0].is_first, self.chunks[-1].is_last
        self.ties_embeddings = self.chunks[0].ties_embeddings
        self.full_config = model.config
        if peft_model is not None:  # LoRA: the PEFT model keeps `model` alive (its config and adapter config are
            _trim(model, self.is_first, self.is_last)  # what the export reads): drop what the chunks do not hold

    @property
    def peft_model(self):
        """The PEFT model (LoRA) whose base model the chunks are shells of, or None."""
        return self._peft[0] if self._peft else None

    def get_output_embeddings(self) -> nn.Module | None:
        """The LM head, on the rank holding the last virtual stage (vocab-parallel under TP, which selects the
        loss and the chunked loss, as for a PipelineStage), else None."""
        return self.chunks[-1].get_output_embeddings()

    def hook_first_layer(self) -> None:
        """Re-register every later chunk's received-states pre-hook ahead of a data-parallel wrapper's (FSDP2)."""
        for c in self.chunks:
            if not c.is_first:
                c.hook_first_layer()

    def forward(self, x: torch.Tensor, chunk: int = 0, **kwargs) -> torch.Tensor:
        """Chunk `chunk`'s forward, called through this module so that a data-parallel wrapper of the whole rank
        (FSDP2's root unit: embedding, final norm, LM head) runs its own hooks around every chunk."""
        return self.chunks[chunk](x, **kwargs)

    @property
    def tied(self) -> nn.Parameter | None:
        """The tied embedding weight this rank holds (rank 0: virtual stage 0's embedding; rank p - 1: the last
        virtual stage's LM head), or None."""
        return next((c.tied for c in self.chunks if c.tied is not None), None)

    def sync_tied_grads(self, group) -> None:
        """Collective over `group` (the pipeline's first and last rank): see PipelineStage.sync_tied_grads."""
        for c in self.chunks:
            if c.tied is not None:
                c.sync_tied_grads(group)

    def save_pretrained(self, save_directory, state_dict: dict, **kwargs) -> None:
        self.chunks[0].save_pretrained(save_directory, state_dict, **kwargs)

    def full_model(self) -> nn.Module:
        return self.chunks[0].full_model()

    def hf_name(self, name: str) -> str:
        """chunks.<c>.<name of chunk c> -> the full model's name."""
        m = re.match(r"chunks\.(\d+)\.(.*)", name)
        if m is None:
            raise ValueError(f"interleaved pipeline: {name!r} is not a parameter of a chunk")
        return self.chunks[int(m.group(1))].hf_name(m.group(2))
