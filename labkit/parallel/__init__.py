"""Tensor parallelism over torch.distributed: process groups, sharded layers and workers."""
