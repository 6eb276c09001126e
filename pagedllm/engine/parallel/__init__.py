"""Tensor parallelism across processes and machines, on torch.distributed.

Rank 0 runs the engine (scheduler, KV allocator, sampler) and a ParallelModelRunner over its shard; the
Executor starts the other ranks on this machine and forms the group; every worker runs worker.py's loop
over its own shard. The sharded layers themselves live in pagedllm/models/parallel.py.
"""
