"""Sizing arithmetic shared by the trainer and the planner: FLOPs, memory, batch size."""
