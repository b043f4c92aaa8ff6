"""One GPU: the sft recipe's tokens/s, memory and MFU (sft.py) and where its step spends its time (profile.py)."""
