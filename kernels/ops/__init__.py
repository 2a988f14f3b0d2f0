"""Triton kernels, each with its torch.library custom ops and autograd.Function (one op per file).

Importing this package requires Triton; `kernels` imports it only when Triton is installed.
"""
