"""The label of a position with no target: torch's cross_entropy ignore_index default, the HF convention.

from hfpar.parallel.labels import IGNORE   # -100: padding, prompts, masked tokens
"""

IGNORE = -100
