"""What a model computes from the sequence it is given besides its attention, made to read the whole rows under
context parallelism (once, in place; outside cp_rows every module computes as transformers does):

    cp_adapt(model)    # enable_cp_attention, the cut-rows check (shard_check.py) and the family sweep

  rotary.py       dynamic rotary embeddings choose their frequencies from the whole rows' largest position
  temperature.py  a query scaling by the token's index in the row takes its index in the whole row (Llama 4)
"""

from __future__ import annotations

from torch import nn

from .rotary import cp_rotary
from .temperature import cp_temperature


def cp_adapt(model: nn.Module) -> list[str]:
    """Both adaptations on `model` (idempotent); returns the names of the modules changed."""
    return cp_rotary(model) + cp_temperature(model)
