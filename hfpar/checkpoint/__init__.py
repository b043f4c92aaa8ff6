"""Checkpoints: the layout of `checkpoint-<step>/`, trainer state, cadence, retention, resume, final export.

    checkpointer.py  save / resume / retention of training states; the final HF-format export
    export.py        `hfpar export`: a checkpoint's per-rank states gathered into an HF model directory
"""
