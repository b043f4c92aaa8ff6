"""Checkpoints: the layout of `checkpoint-<step>/`, trainer state, cadence, retention, resume, final export.

checkpointer.py  Checkpointer (what the trainer calls): trainer state, cadence, save / retention, resume
write.py         the one write of a checkpoint (staged, fsynced, manifested, renamed), its read, retention
layout.py        the output dir's layout and what is read of it without a tensor (latest, trainer_state.json)
output_dir.py    the output dir's lock (one run at a time) and ownership (only what hfpar wrote is touched)
rank_state.py    per-rank tensors the backends' save_rank_state / load_rank_state write and read; each rank's RNG
manifest.py      MANIFEST.json: every file's size and SHA-256, written last, verified before a resume / export
safe_load.py     safe_loading(): every torch.load weights_only, DCP metadata through a restricted unpickler
file_checks.py   model weights and data files a run is pointed at, checked before any work
full_state.py    the mesh-independent form (full tensors under HF names, model and optimizer) of any checkpoint
zero_state.py    a DeepSpeed ZeRO checkpoint's flat partitions joined into that form (DeepSpeed's zero_to_fp32)
final_model.py   the final model in HF format at the output dir's root (gather, write, tokenizer)
export.py        `hfpar export`: a checkpoint's per-rank states gathered into an HF model directory
"""
