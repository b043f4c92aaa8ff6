"""The sft recipe against transformers.Trainer, a plain loop and TRL (sft.py)."""
