"""Pipeline parallelism: an HF decoder cut by layers into stages, run by GPipe / 1F1B schedules.

    stage.py     PipelineStage (the model trimmed to its layers, HF forward kept), balanced_split, parse_split
    schedule.py  PipelineRunner: micro-batches through the stages, activations and grads point to point

The recipes run them with --pp_size (hfpar.backends.pipeline); tests/test_pp_stages.py shows them in a plain loop.
"""

from .schedule import SCHEDULES, PipelineRunner, microbatches, schedule_order, split_microbatches
from .stage import PipelineStage, balanced_split, decoder_layers, parse_split, tied_embedding_group

__all__ = ["SCHEDULES", "PipelineRunner", "microbatches", "schedule_order", "split_microbatches", "PipelineStage", "balanced_split",
           "decoder_layers", "parse_split", "tied_embedding_group"]
