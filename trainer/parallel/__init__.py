"""Tensor, sequence, pipeline and context parallelism on one DeviceMesh (docs/parallelism.md).

One concern per file: mesh.py (the mesh from the layout), tensor.py (TP/SP with DTensor),
context.py (CP: sequence chunks, all-gathered keys and values), pipeline.py (stages and
schedules), grads.py (gradients averaged over replicas, norms over shards), engine.py (the
step that composes them), dcp.py (checkpoints that load under another layout).
"""
