"""HF semantics on a tensor-parallel causal LM: `model(**batch).loss`, generate(), and the logit gather.

    apply_tensor_parallel(model, tp_group)                 # installs what is below on a vocab-parallel LM head
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss                                               # == the unsharded model's loss (HF ForCausalLMLoss)
    out.logits                                             # (B, T, V/tp): this rank's vocab slice, kept for memory
    full = gather_vocab_logits(out.logits, tp_group)       # (B, T, V) when a caller needs them (autograd-aware)
    model.generate(ids, max_new_tokens=8)                  # the head gathers its logits during generate()

The loss goes in through transformers' own hook: every *ForCausalLM forward calls
`self.loss_function(logits, labels, vocab_size, **kwargs)` (the `loss_function` property returns
`model._loss_function` when set). VocabParallelCausalLMLoss mirrors transformers.loss.loss_utils.ForCausalLMLoss:
labels shifted left (or `shift_labels=` taken as is), ignore_index -100, `num_items_in_batch` -> sum / that
count, else the mean over non-ignored targets; computed by vocab_parallel_cross_entropy on the shards (fp32).
Under sequence parallelism the LM head all-gathers the sequence first, so the logits are (B, T, V/tp) in both
modes and the loss is the same code. A forward that computed its loss without `self.loss_function` (so on
shards) is refused after the fact. Task heads that stay replicated (sequence classification) keep HF's loss.
"""

from __future__ import annotations

import inspect
import types
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss

from ..comm import gather_from_parallel_region, group_size
from .loss import vocab_parallel_cross_entropy

__all__ = [
    "VocabParallelCausalLMLoss",
    "computes_own_loss",
    "full_vocab_logits",
    "gather_vocab_logits",
    "install_hf_semantics",
]

CAUSAL_LOSS_TYPES = (None, "ForCausalLM", "ForConditionalGeneration")


def gather_vocab_logits(logits: torch.Tensor, group=None) -> torch.Tensor:
    """(..., V/tp) vocab shards of a tensor-parallel LM head -> (..., V) on every rank (rank order = vocab order).
    Collective over the TP group; backward keeps this rank's slice of the gradient. Costs the full (..., V)."""
    return gather_from_parallel_region(logits, getattr(group, "tp_group", group))


def computes_own_loss(model: nn.Module) -> bool:
    """Whether the model's forward computes its loss by code of its own, not through `self.loss_function` (CPM-Ant:
    CrossEntropyLoss on the logits as they come): a vocab-parallel LM head would hand it shards, so the plans keep
    such a head (and an embedding tied to it) whole. Read from the forward's source; none to read: False."""
    try:
        src = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return False
    return "loss_function" not in src and ("CrossEntropyLoss" in src or "cross_entropy" in src)


class VocabParallelCausalLMLoss:
    """transformers' ForCausalLMLoss on vocab-parallel logits (installed as `model.loss_function`)."""

    def __init__(self, group, full_vocab: int | None = None) -> None:
        self.group, self.tp, self.calls, self.full_vocab = group, group_size(group), 0, full_vocab

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor | None,
        vocab_size: int | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        self.calls += 1
        # the LM head's full width tells gathered logits (full_vocab_logits) from shards: some forwards pass
        # vocab_size=logits.shape[-1] (Inkling), the shard's own width
        full = self.full_vocab or vocab_size
        if full is not None and self.tp > 1 and logits.shape[-1] == full:  # gathered: full_vocab_logits
            return ForCausalLMLoss(logits, labels, full, num_items_in_batch, ignore_index, shift_labels, **kwargs)
        if full is not None and logits.shape[-1] * self.tp != full:
            raise ValueError(
                f"tensor-parallel loss: logits {tuple(logits.shape)} x tp {self.tp} do not make vocab_size {full}"
            )
        if shift_labels is None:  # tokens < n predict n
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]  # (B, T)
        shift_labels = shift_labels.to(logits.device)
        reduction = "sum" if num_items_in_batch is not None else "mean"
        loss = vocab_parallel_cross_entropy(
            logits, shift_labels, group=self.group, ignore_index=ignore_index, reduction=reduction
        )
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss


@contextmanager
def full_vocab_logits(model: nn.Module):
    """Inside the block the vocab-parallel LM head all-gathers its logits: (B, T, V) on every rank (eval,
    scoring, generation). Refused under sequence parallelism (see install_hf_semantics)."""
    head = model.get_output_embeddings()
    if getattr(model, "_hfpar_sequence_parallel", False):
        raise ValueError(
            "tensor-parallel model with sequence_parallel=True: generate() / full_vocab_logits "
            "are not supported (a 1-token decoding step cannot be split along the sequence); "
            "apply_tensor_parallel without sequence_parallel, or export and load the model"
        )
    before = head.gather_output
    head.gather_output = True
    try:
        yield model
    finally:
        head.gather_output = before


def _generate(self, *args, **kwargs):
    """GenerationMixin.generate with the LM head gathering its vocab shards (greedy / sampling read
    logits[:, -1, :] over the full vocab)."""
    with full_vocab_logits(self):
        return type(self).generate(self, *args, **kwargs)


# ----------------------------------------------------------------------------- hooks
def _pre_hook(module, args, kwargs, *, sequence_parallel: bool, loss_fn):
    if sequence_parallel and kwargs.get("logits_to_keep", 0) not in (0, None):
        raise ValueError(
            "sequence-parallel model: logits_to_keep must be 0 (each rank holds T/tp positions before lm_head)"
        )
    labels = kwargs.get("labels") is not None
    if labels and loss_fn is None:
        raise ValueError(
            f"tensor-parallel model: {type(module).__name__} has vocab-parallel logits (B, T, V/tp) "
            f"and loss_type {getattr(module, 'loss_type', None)!r}, which hfpar does not compute on "
            "shards; call the model without labels= and use "
            "hfpar.parallel.tensor_parallel.vocab_parallel_cross_entropy(logits, targets, group=tp_group)"
        )
    if labels:
        module._hfpar_loss_calls = loss_fn.calls


def _post_hook(module, args, kwargs, output, *, loss_fn):
    if (
        kwargs.get("labels") is not None
        and module.loss_function is loss_fn
        and loss_fn.calls == getattr(module, "_hfpar_loss_calls", loss_fn.calls)
    ):
        raise ValueError(
            f"tensor-parallel model: {type(module).__name__}.forward computed its loss without "
            "self.loss_function, i.e. on vocab shards (wrong); call it without labels= and use "
            "vocab_parallel_cross_entropy(logits, targets, group=tp_group)"
        )


def install_hf_semantics(model: nn.Module, group, *, sequence_parallel: bool, vocab_parallel_head: bool) -> None:
    """Called by apply_tensor_parallel once the model is sharded. With a vocab-parallel LM head: the loss hook,
    generate() through full_vocab_logits, and the guards; a replicated head keeps HF's loss untouched."""
    loss_fn = None
    model._hfpar_sequence_parallel = sequence_parallel
    if vocab_parallel_head and getattr(model, "loss_type", None) in CAUSAL_LOSS_TYPES:
        head = model.get_output_embeddings()
        loss_fn = VocabParallelCausalLMLoss(group, getattr(head, "out_features", None))
        model.loss_function = loss_fn  # transformers' property setter
    if vocab_parallel_head and hasattr(model, "generate"):
        model.generate = types.MethodType(_generate, model)  # instance attribute: deepcopy rebinds it
    if vocab_parallel_head:
        model.register_forward_pre_hook(
            partial(_pre_hook, sequence_parallel=sequence_parallel, loss_fn=loss_fn), with_kwargs=True
        )
        if loss_fn is not None:
            model.register_forward_hook(partial(_post_hook, loss_fn=loss_fn), with_kwargs=True)
