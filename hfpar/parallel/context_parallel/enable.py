"""Switching a model's attention to context parallelism's and back, once the model is checked.

enable_cp_attention(model)        # every attention of its language model through "hfpar_cp"
with whole_sequence(model):       # the attention it replaced (generation: whole rows, a KV cache)
    ...
"""

from __future__ import annotations

import contextlib
import warnings

from ..language_model import language_model
from .adapt import cp_adapt
from .attention import NAME, register_cp_attention
from .gathered import gather_mixers
from .mixing import token_mixers
from .shard_check import shard_problem


def enable_cp_attention(model) -> None:
    """Every attention of `model`'s language model through hfpar's, the implementation it replaces remembered
    (whole_sequence). A multimodal wrapper's towers keep theirs: their patches are not the sharded sequence.
    A module that mixes tokens outside the attention (mixing.py: Mamba, linear attention, a causal convolution) runs on
    the whole rows (gathered.py), said once in a warning; ValueError in one line where one cannot (it calls the
    attention itself) or the model computes otherwise once its rows are cut (shard_check.py). Dynamic rotary
    embeddings are made to choose their frequencies from the whole rows (rotary.py), a query scaling by the token's
    index in the row to take its index in the whole row (temperature.py)."""
    mixers, why = token_mixers(model.config)
    if why := why or shard_problem(model.config):
        raise ValueError(f"context parallelism: {why}")
    lm = language_model(model)
    if names := gather_mixers(lm, mixers):
        warnings.warn(
            f"context parallelism: {len(names)} modules mix tokens outside the attention ({names[0]}, ...: "
            f"{', '.join(c.rsplit('.', 1)[-1] for c in mixers)}); each runs on the whole rows on every cp rank "
            "(exact; their compute and activations are not divided by cp_size, the rest of the model's are)",
            stacklevel=2,
        )
    before = lm.config._attn_implementation
    lm.set_attn_implementation(register_cp_attention())
    cp_adapt(lm)  # dynamic rotary, Llama 4's attention temperature: computed from the whole rows, as one process
    model._hfpar_attn_before_cp = before


@contextlib.contextmanager
def whole_sequence(model):
    """Within: the attention that context parallelism replaced (generation: each rank holds whole rows, with a KV
    cache and transformers' masks); nothing to do for a model without it."""
    before = getattr(model, "_hfpar_attn_before_cp", None)
    if before is None:
        yield
        return
    lm = language_model(model)
    lm.set_attn_implementation(before)
    try:
        yield
    finally:
        lm.set_attn_implementation(NAME)
