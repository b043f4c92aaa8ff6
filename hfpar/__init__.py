"""hfpar: fine-tune Hugging Face transformers with DDP, FSDP2, DeepSpeed ZeRO, tensor and expert parallelism."""

__version__ = "0.1.0"
