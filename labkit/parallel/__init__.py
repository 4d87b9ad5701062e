"""Tensor and expert parallelism over torch.distributed: process groups, sharded layers,
placed experts (expert.py) and workers."""
