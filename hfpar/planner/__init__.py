"""The planner behind `hfpar plan`: bytes per GPU of every strategy for a model, from its config alone.

memory.py    ModelStats, activation / host-RAM bytes, PlannerError (imports nothing else of planner/)
pipeline.py  pipeline stages: bytes per stage, in-flight micro-batches, the bubble
table.py     estimate / candidates / recommend / memory_table: the table `hfpar plan` prints
"""
