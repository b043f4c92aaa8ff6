"""Checkpoints: the layout of `checkpoint-<step>/`, trainer state, cadence, retention, resume, final export.

    checkpointer.py  Checkpointer (what the trainer calls): trainer state, cadence, save / retention, resume
    layout.py        the output dir's layout and what is read of it without a tensor (latest, trainer_state.json)
    rank_state.py    per-rank tensors the backends' save_rank_state / load_rank_state write and read
    final_model.py   the final model in HF format at the output dir's root (gather, write, tokenizer)
    export.py        `hfpar export`: a checkpoint's per-rank states gathered into an HF model directory
"""
