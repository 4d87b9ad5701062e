"""Run under torchrun by tests/parallel/test_torchrun.py: rank 0 builds an LLM over the launched
ranks and makes rank 1 (on the other "node") raise once; the others serve it. Prints what rank
0 saw."""

import sys

import torch

from labkit import LLM
from labkit.parallel.launch import exit_rank, torchrun_env, worker_loop
from labkit.parallel.workers import WorkerError

if __name__ == "__main__":
    rank, world, _ = torchrun_env()
    if rank:
        exit_rank(worker_loop("cpu"))
    llm = LLM(sys.argv[1], tensor_parallel_size=world, enable_expert_parallel=True,
              dtype=torch.float32, distributed_executor_backend="external_launcher")
    workers = llm.llm_engine.executor.runner.workers
    print("places", len(workers.places))
    workers.target.fail = lambda message: None  # rank 0 passes: the error must come from afar
    try:
        workers.call("fail", "boom on purpose")
    except WorkerError as e:
        print("WorkerError", str(e).splitlines()[0], "|", str(e).strip().splitlines()[-1])
    try:
        workers.call("kv_heads")
    except WorkerError as e:
        print("after", str(e).splitlines()[0])
    llm.shutdown()
    exit_rank(0)
