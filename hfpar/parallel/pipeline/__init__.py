"""Pipeline parallelism: an HF decoder cut by layers into stages, run by GPipe / 1F1B schedules.

    stage.py     PipelineStage (the model trimmed to its layers, HF forward kept), balanced_split, parse_split
    schedule.py  PipelineRunner: micro-batches through the stages, activations and grads point to point

Not yet wired into the recipes (`--pp_size`): use the layers in your own loop (tests/test_pp_stages.py shows how).
"""

from .schedule import SCHEDULES, PipelineRunner, schedule_order, split_microbatches
from .stage import PipelineStage, balanced_split, decoder_layers, parse_split

__all__ = ["SCHEDULES", "PipelineRunner", "schedule_order", "split_microbatches", "PipelineStage", "balanced_split",
           "decoder_layers", "parse_split"]
