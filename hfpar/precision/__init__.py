"""Training precision beyond Accelerate's bf16 / fp16: fp8 through torchao's float8 (fp8.py: the settings from the
accelerate config, the one-line refusals, the model conversion). A folder of its own because hfpar.distributed reads
it while building the Accelerator, before the trainer and the backends exist (no import cycle through hfpar.train).
"""
