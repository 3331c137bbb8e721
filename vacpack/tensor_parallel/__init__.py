"""Tensor parallelism: one model over several processes (GPUs, or a CPU's cores), each rank
holding 1/N of every sharded weight and of the KV heads.

`load_tensor_parallel` starts the group from rank 0 (the caller's process) and returns rank 0's
LoadedModel; `worker.run_worker` is what every other rank runs. Rank 0's engine and corpus jobs
drive the others through the programs of vacpack/distributed/driver.py.
"""

from vacpack.tensor_parallel.launch import load_tensor_parallel

__all__ = ["load_tensor_parallel"]
