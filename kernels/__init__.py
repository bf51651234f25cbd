"""Triton kernels (fused and collective-aware) and their torch fallbacks.

Each fused kernel is a ``torch.library`` custom op (``torch.ops.autopar.*``) with a fake
implementation (so it traces, runs on the meta device and is probed by ``passes/analyze.py`` like
any aten op) and a registered backward; its implementation runs Triton or the torch fallback
(``kernels/dispatch.py``). ``passes/fuse.py`` rewrites matched aten patterns of the traced graph into
these ops, so the search prices and shards them like any other op and the generated module calls
them on local pieces.
"""
