"""`hfpar plan`: bytes per GPU of every strategy for a model, from its config alone.

    memory.py    ModelStats, activation / host-RAM bytes, PlanError (imports nothing else of plan/)
    pipeline.py  pipeline stages: bytes per stage, in-flight micro-batches, the bubble
    planner.py   estimate / candidates / recommend / plan: the table `hfpar plan` prints
"""
