"""Triton kernels (fused and collective-aware) and their torch fallbacks.

Empty in v0: the code generator emits plain aten ops and torch.distributed collectives.
"""
