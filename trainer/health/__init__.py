"""Training health: stragglers by rank, silent data corruption, hangs (docs/reliability.md).

collectives.py  time each rank spends blocked in collectives (fed by trainer/distributed.py)
stragglers.py   per-rank step/data/wait times, gathered on logged steps; the straggler score
sdc.py          cross-replica checksums of parameters and optimizer state; the odd rank out
replay.py       a step run twice from one snapshot must reproduce bitwise (one process too)
watchdog.py     no progress for hang_timeout_seconds: every rank dumps its stacks, the job fails
faults.py       fault injection for tests and the guide (KITCHEN_FAULTS)
monitor.py      the one object the training loop talks to
"""
