"""The training loop and what it computes with: one loop for every recipe and every composition.

trainer.py       Trainer: accumulation, global-token loss normalization, backend clip / step, eval, logging;
                 calls the Checkpointer and the RunRecorder, never called back by them
losses.py        the recipes' loss functions (token-summed, normalized by the global token count)
batch_plan.py    the global-token count of a step's micro-batches, known before the first forward
sampler.py       the global-batch sampler by data-parallel rank
schedules.py     learning-rate schedules (HF names)
prefetch.py      the next steps' batches read, collated, counted and copied to the device ahead, in a thread
compile.py       regional compilation: each decoder block compiled in place (--torch_compile)
liger.py         Liger's kernels in the model's modules (--use_liger_kernel)
varlen.py        variable-length attention over one-row padding-free batches (--attn_implementation hfpar_varlen)
"""

from hfpar.parallel.exports import lazy_exports

# --attn_implementation's name for varlen.py, here so the preflight and the data plan compare without importing it
VARLEN = "hfpar_varlen"

__getattr__, __dir__, __all__ = lazy_exports(__name__, {".varlen": ("register_varlen_attention",)})
__all__ = [*__all__, "VARLEN"]
