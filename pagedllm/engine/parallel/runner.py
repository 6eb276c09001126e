"""ParallelModelRunner: rank 0's model runner; each step goes to every rank before rank 0 runs its shard."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.engine.model_runner import ModelRunner, StepInputs
from pagedllm.engine.parallel import protocol
from pagedllm.engine.parallel.executor import Executor, WorkerFailure
from pagedllm.lora_request import LoRARequest
from pagedllm.models.parallel import CollectiveError


class ParallelModelRunner(ModelRunner):
    """A ModelRunner over rank 0's shard of the model and KV cache. Every step's inputs are broadcast to
    the workers, which run the same forward on their shards; the logits are gathered here."""

    def __init__(self, executor: Executor, *args, **kwargs):
        """ModelRunner's arguments for rank 0's shard; returns once every rank has allocated its cache."""
        super().__init__(*args, **kwargs)
        self.executor = executor
        self.named: dict[int, LoRARequest] = {}  # the adapters the workers were told of, by id
        executor.start(
            self.num_blocks,
            self.block_size,
            self.kv_dtype,
            self.num_host_blocks,
            self.prefault_kv_cache,
            self.groups,
        )

    def calibrate_key_smoothing(self, input_ids: np.ndarray) -> None:
        """Every rank calibrates its own KV heads' smoothing on the same forward pass."""
        if self.executor.failure is not None:
            raise WorkerFailure(self.executor.failure)
        try:
            self.executor.tp.broadcast(protocol.op_header(protocol.CALIBRATE, len(input_ids)))
            self.executor.tp.broadcast(torch.from_numpy(input_ids.astype(np.int64)))
            super().calibrate_key_smoothing(input_ids)
        except CollectiveError as error:
            raise self.executor.fail(error) from error

    def execute_step(self, step: StepInputs) -> torch.Tensor:
        if self.executor.failure is not None:
            raise WorkerFailure(self.executor.failure)
        try:
            self._name_adapters(step.lora_ids)
            header, payload = protocol.pack(step)
            self.executor.tp.broadcast(header)
            self.executor.tp.broadcast(payload)
            return super().execute_step(step)
        except CollectiveError as error:
            raise self.executor.fail(error) from error

    def _name_adapters(self, lora_int_ids: list[int]) -> None:
        """Tell the workers each of the step's adapters they have not been told of under its id."""
        for lora_int_id in lora_int_ids:
            lora = self.loras.loaded[lora_int_id]
            request = LoRARequest(lora.name, lora.int_id, lora.path)
            if self.named.get(lora_int_id) != request:
                for message in protocol.lora_message(request):
                    self.executor.tp.broadcast(message)
                self.named[lora_int_id] = request
