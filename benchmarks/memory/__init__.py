"""Host memory: loading under each strategy (host.py) and the LM loss's peak (loss.py)."""
