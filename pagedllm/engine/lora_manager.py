"""The engine's LoRA adapters: loaded on first use, kept in memory in a bounded LRU, handed to each step.

At most `max_cpu_loras` adapters stay loaded: loading one more drops the least recently used adapter
that no unfinished request holds (one that every loaded adapter's requests hold waits until they finish:
the LRU goes over its bound meanwhile, and shrinks back as they release). The scheduler runs at most
`max_loras` adapters in one step (engine/scheduler.py); the runner asks for the step's adapters here.
Under tensor parallelism every worker rank keeps its own part of each adapter (RankLoRAs), loaded when
rank 0 first names it.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict

import torch

from pagedllm.lora_request import LoRARequest
from pagedllm.models.lora import LoRAModel, LoRAState, attach_lora, load_lora

logger = logging.getLogger(__name__)


class LoRAManager:
    """Adapters by lora_int_id: the requests that named them, those loaded, and who holds them."""

    def __init__(self, model: torch.nn.Module, max_lora_rank: int, max_cpu_loras: int, dtype: torch.dtype):
        self.model, self.dtype = model, dtype
        self.max_lora_rank, self.max_cpu_loras = max_lora_rank, max_cpu_loras
        self.state: LoRAState = attach_lora(model)
        self.loaded: OrderedDict[int, LoRAModel] = OrderedDict()  # least recently used first
        self.users: Counter[int] = Counter()  # unfinished requests holding each adapter
        self.known: dict[int, LoRARequest] = {}  # every adapter named so far, by id
        self.num_loads = 0  # adapters read from their folders, over the manager's life

    def acquire(self, request: LoRARequest) -> LoRAModel:
        """A request runs under `request`'s adapter: load it if it is not in memory (a bad adapter is
        refused before anything of it loads), and hold it until `release`. An id names one adapter."""
        known = self.known.get(request.lora_int_id)
        if known is not None and (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path):
            raise ValueError(
                f"lora_int_id={request.lora_int_id} already names adapter {known.lora_name!r} at "
                f"{known.lora_path!r}, not {request.lora_name!r} at {request.lora_path!r}"
            )
        lora = self.loaded.get(request.lora_int_id)
        if lora is None:
            lora = load_lora(
                request.lora_name, request.lora_int_id, request.lora_path, self.model, self.max_lora_rank,
                self.dtype,
            )  # fmt: skip
            self.loaded[request.lora_int_id] = lora
            self.num_loads += 1
            logger.info("loaded LoRA adapter %r (%d bytes)", request.lora_name, lora.nbytes)
        self.known[request.lora_int_id] = request
        self.loaded.move_to_end(request.lora_int_id)
        self.users[request.lora_int_id] += 1
        self._evict()
        return lora

    def preload(self, request: LoRARequest) -> None:
        """Check and load `request`'s adapter ahead of its requests, held by none (the LRU may evict it)."""
        self.acquire(request)
        self.release(request.lora_int_id)

    def release(self, lora_int_id: int) -> None:
        """A request under the adapter finished or was aborted (a removed adapter's last one drops it)."""
        self.users[lora_int_id] -= 1
        if self.users[lora_int_id] <= 0:
            del self.users[lora_int_id]
            if lora_int_id not in self.known:
                self.loaded.pop(lora_int_id, None)
        self._evict()

    def remove(self, lora_int_id: int) -> None:
        """Forget an adapter (a server unloaded it): out of memory now, or when its last request ends."""
        self.known.pop(lora_int_id, None)
        if not self.users[lora_int_id]:
            self.loaded.pop(lora_int_id, None)

    def _evict(self) -> None:
        """Beyond max_cpu_loras, drop the least recently used adapters no unfinished request holds."""
        for lora_int_id in list(self.loaded):
            if len(self.loaded) <= self.max_cpu_loras:
                return
            if not self.users[lora_int_id]:
                del self.loaded[lora_int_id]

    def step_adapters(self, lora_int_ids: list[int]) -> list[LoRAModel]:
        """The loaded adapters of a step's requests (each held by them, so never evicted)."""
        return [self.loaded[lora_int_id] for lora_int_id in lora_int_ids]


class RankLoRAs(LoRAManager):
    """A tensor-parallel worker rank's adapters: rank 0 names each one (`follow`) before a step runs it;
    this rank loads its part of it on first use, keeps at most max_cpu_loras, and reloads one its LRU
    dropped (rank 0's may hold more, for its running requests)."""

    def follow(self, request: LoRARequest) -> None:
        """Rank 0 runs `request`'s adapter under its id (an id it reused for another adapter is replaced)."""
        known = self.known.get(request.lora_int_id)
        if known is not None and known != request:
            self.remove(request.lora_int_id)
        self.known[request.lora_int_id] = request

    def step_adapters(self, lora_int_ids: list[int]) -> list[LoRAModel]:
        adapters = [self.acquire(self.known[lora_int_id]) for lora_int_id in lora_int_ids]
        for lora_int_id in lora_int_ids:
            self.release(lora_int_id)
        return adapters
