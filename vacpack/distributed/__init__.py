"""Several processes running one model: torch.distributed process groups, rank 0's control
messages to the other ranks, and the worker processes themselves (tensor parallelism).

Nothing here knows about models or engines: `collectives` moves tensors between ranks,
`control` carries rank 0's host-side messages, `workers` starts and watches the other ranks'
processes, `driver` is rank 0's side of a running group.
"""
