"""The planner behind `hfpar plan`: bytes per GPU of every strategy for a model, from its config alone.

memory.py    ModelStats, activation / host-RAM bytes, PlannerError (imports nothing else of planner/)
pipeline.py  pipeline stages: bytes per stage, in-flight micro-batches, the bubble
candidates.py  the layouts considered (candidates), the one recommended (recommend), its launch command
table.py     estimate / memory_table: the table `hfpar plan` prints
"""
