"""Pipeline parallelism: an HF decoder cut by layers into stages, run by GPipe / 1F1B / interleaved 1F1B schedules.

    stage.py     PipelineStage (the model trimmed to its layers, HF forward kept), balanced_split, parse_split
    boundary.py  what a stage hands on: the layer list, what runs after the layers (dropped but on the last stage)
    check.py     pipeline_problem: stages cut at every layer of the model's tiny copy against the unsplit copy
    chunks.py    PipelineChunks: the V chunks of one rank for the interleaved schedule (virtual stages r, r + p, ..)
    schedule.py  PipelineRunner: micro-batches through the stages, activations and grads point to point

The recipes run them with --pp_size (hfpar.backends.pipeline); tests/distributed/test_pp_stages.py shows them in a plain
loop.
"""

from ..exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".chunks": (
            "PipelineChunks",
            "chunk_layers",
        ),
        ".schedule": (
            "SCHEDULES",
            "PipelineRunner",
            "microbatches",
            "pipeline_stages",
            "schedule_order",
            "split_microbatches",
        ),
        ".stage": (
            "PipelineStage",
            "balanced_split",
            "decoder_layers",
            "parse_split",
            "pipeline_problem",
            "tied_embedding_group",
        ),
    },
)
