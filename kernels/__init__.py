"""Triton kernels for labkit, importable as ``labkit.kernels``.

One kernel per file, each with a plain-PyTorch reference beside it. On a machine without a GPU
set ``TRITON_INTERPRET=1`` before importing triton and the kernels run on CPU tensors.
"""
