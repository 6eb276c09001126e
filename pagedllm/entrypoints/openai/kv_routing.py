"""Routing on what each replica's prefix cache holds, learnt from its KV cache events (vLLM's shape).

Ray's PrefixCacheAffinityRouter keeps a tree of the prompt text each replica was *sent*: it never hears of
an eviction, and a request it balances away from its cached replica marks that prompt as held by both
from then on. Here the replicas say what they *hold*:

- each replica's engine logs its prefix cache's changes (kv/events.py); the replica publishes them every
  `PUBLISH_INTERVAL_S` as vLLM's `KVEventBatch` (msgpack: `[ts, [["BlockStored", hashes, parent,
  token_ids, block_size, lora_id, medium], ["BlockRemoved", hashes, medium], ["AllBlocksCleared"]]]`,
  what `msgspec.msgpack.Decoder(vllm.distributed.kv_events.KVEventBatch)` reads) to `KVCacheIndex`, one
  Ray actor per application holding each replica's set of block hashes;
- the ingress computes each request's prompt block hashes (`PromptBlocks`: the engine's tokenizer, chat
  template and hash chain, under the LoRA adapter the request's `model` names, as the engine keys its
  blocks) and passes them in the call's `RoutingKey`;
- `KVCacheAwareRouter`, a Ray Serve `RequestRouter`, asks the index how many leading blocks each replica
  holds and sends the request where `uncached prompt tokens + load_tokens x requests in flight` is least.
  Requests it routed that have not finished count as held on their replica (their blocks are computed,
  or about to be, before the replica's events can say so).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass

import msgpack
import ray
from pydantic import BaseModel
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedllm.entrypoints.openai import protocol as p
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.serving_chat import chat_text
from pagedllm.entrypoints.openai.serving_completion import prompts_of
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.tools import plan_tools, template_messages
from pagedllm.kv.block_pool import block_hash_chain
from pagedllm.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, KVEventLog

logger = logging.getLogger(__name__)

PUBLISH_INTERVAL_S = 0.1  # how stale a replica's published state may be, beside the router's own record
INDEX_ACTOR = "PagedllmKVCacheIndex"


@dataclass(frozen=True)
class RoutingKey:
    """What a request router reads: `prompt`, the text a request's KV blocks start with (Ray's prefix
    router), and `block_hashes`, the hash chain of its prompt's full blocks (KVCacheAwareRouter)."""

    prompt: str
    block_hashes: tuple[bytes, ...] = ()
    num_tokens: int = 0  # of the prompt
    block_size: int = 16


# -- vLLM's wire shape ----------------------------------------------------------------------------------


def encode_batch(events: list[KVCacheEvent], ts: float) -> bytes:
    """A KVEventBatch as vLLM's msgspec structs encode it (array-like, tagged by class name)."""
    rows = []
    for event in events:
        if isinstance(event, BlockStored):
            fields = [event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size]
            rows.append(["BlockStored", *fields, event.lora_id, event.medium])
        elif isinstance(event, BlockRemoved):
            rows.append(["BlockRemoved", event.block_hashes, event.medium])
        else:
            rows.append(["AllBlocksCleared"])
    return msgpack.packb([ts, rows], use_bin_type=True)


def decode_batch(payload: bytes) -> tuple[float, list[KVCacheEvent]]:
    ts, rows = msgpack.unpackb(payload, raw=False)
    kinds = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}
    return ts, [kinds[row[0]](*row[1:]) for row in rows]


# -- the replicas' side ---------------------------------------------------------------------------------


class KVCacheIndex:
    """Each replica's prefix blocks (the first KV group's hashes), kept from its event batches."""

    def __init__(self):
        self.held: dict[str, set[bytes]] = {}
        self.next_seq: dict[str, int] = {}
        self.num_events = 0

    def publish(self, replica: str, seq: int, payload: bytes) -> None:
        """Apply a replica's batch number `seq` (its first is 0; a gap means batches were lost)."""
        expected = self.next_seq.get(replica, 0)
        if seq != expected:
            logger.warning("replica %s: KV event batch %d, expected %d: some lost", replica, seq, expected)
        self.next_seq[replica] = seq + 1
        held = self.held.setdefault(replica, set())
        _, events = decode_batch(payload)
        for event in events:
            if isinstance(event, AllBlocksCleared):
                held.clear()
            elif isinstance(event, BlockStored):
                held.update(event.block_hashes)
            else:
                held.difference_update(event.block_hashes)
        self.num_events += len(events)

    def match(self, block_hashes: list[bytes], replicas: list[str]) -> list[tuple[int, int]]:
        """For each replica: (leading blocks of the chain it holds, blocks it holds in all)."""
        found = []
        for replica in replicas:
            held = self.held.get(replica, set())
            n = 0
            while n < len(block_hashes) and block_hashes[n] in held:
                n += 1
            found.append((n, len(held)))
        return found

    def forget(self, replicas: list[str]) -> None:
        for replica in replicas:
            self.held.pop(replica, None)
            self.next_seq.pop(replica, None)

    def state(self) -> dict:
        return {"blocks": {r: len(h) for r, h in self.held.items()}, "num_events": self.num_events}


def kv_index(app_name: str):
    """The application's KVCacheIndex actor, started by whoever asks first; Serve's shutdown stops it."""
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    index = (
        ray.remote(KVCacheIndex)
        .options(
            name=INDEX_ACTOR,
            namespace=f"{SERVE_NAMESPACE}::{app_name}",
            get_if_exists=True,
            lifetime="detached",  # outlives the replica or router that started it; Serve stops it
            num_cpus=0,
        )
        .remote()
    )
    # as Ray's PrefixCacheAffinityRouter registers its tree actor: serve.shutdown() kills it
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    ray.get(controller._register_shutdown_cleanup_actor.remote(index))
    return index


class KVEventPublisher:
    """Sends a replica's KV events to the index every PUBLISH_INTERVAL_S, from a thread of its own."""

    def __init__(self, log: KVEventLog, replica: str, app_name: str):
        self.log, self.replica, self.index = log, replica, kv_index(app_name)
        self.seq = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(PUBLISH_INTERVAL_S):
            events = self.log.drain()
            if events:  # a Ray actor runs one caller's calls in the order they were made
                self.index.publish.remote(self.replica, self.seq, encode_batch(events, time.time()))
                self.seq += 1

    def stop(self) -> None:
        self.stopped.set()


# -- the ingress's side ---------------------------------------------------------------------------------


class PromptBlocks:
    """The block hash chain of a request's prompt as its replica's engine will compute it. `models`: the
    replicas' adapters by name (each replica numbers the same --lora-modules alike): a request naming one
    is hashed under its lora_int_id, so it goes where that adapter's blocks are, never the base's."""

    def __init__(self, tokenizer, model: str, block_size: int, models: OpenAIServingModels | None = None):
        self.tokenizer, self.model, self.block_size = tokenizer, model, block_size
        self.models = models

    def key(self, prompt: str, request: BaseModel | None) -> RoutingKey:
        """`prompt` with the hash chain (a completion request of several prompts: its first's); none for
        a request without a prompt or one its replica will refuse."""
        try:
            ids = self._token_ids(request)
        except APIError:  # the replica refuses it with the same error; it needs no routing
            ids = None
        if not ids:
            return RoutingKey(prompt)
        lora = self.models.lora_request(request.model) if self.models is not None else None
        hashes = block_hash_chain(ids, self.block_size, lora.lora_int_id if lora is not None else None)
        return RoutingKey(prompt, tuple(hashes), len(ids), self.block_size)

    def _token_ids(self, request: BaseModel | None) -> list[int] | None:
        tokenizer = self.tokenizer
        if isinstance(request, p.ChatCompletionRequest):
            plan = plan_tools(request, getattr(tokenizer, "chat_template", None))
            messages = template_messages(request.messages)
            text = chat_text(
                tokenizer,
                self.model,
                messages,
                request.add_generation_prompt,
                plan.tools,
                request.chat_template_kwargs,
            )
            return tokenizer.encode(text, add_special_tokens=False)
        if isinstance(request, p.CompletionRequest):
            prompt = prompts_of(request.prompt)[0]
            if isinstance(prompt, str):
                return tokenizer.encode(prompt) if tokenizer is not None else None
            return list(prompt)
        return None


class KVCacheAwareRouter(RequestRouter):
    """Each request to the replica where its uncached prompt tokens plus `load_tokens` per request in
    flight there is least: the longest cached prefix wins unless its replica is that much busier."""

    def initialize_state(self, load_tokens: float = 64.0) -> None:
        self.load_tokens = load_tokens
        self.index = kv_index(self._deployment_id.app_name)
        self.in_flight: dict[str, tuple[ReplicaID, tuple[bytes, ...]]] = {}  # request id -> where, what
        self.sent: dict[ReplicaID, Counter] = {}  # block hash -> requests in flight there that hold it
        self.load: Counter = Counter()  # requests in flight by replica

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        key = _routing_key(pending_request)
        if not candidate_replicas or key is None:
            return [candidate_replicas]
        names = [r.replica_id.unique_id for r in candidate_replicas]
        found = await self.index.match.remote(list(key.block_hashes), names) if key.block_hashes else None
        scored = []
        for i, replica in enumerate(candidate_replicas):
            rid = replica.replica_id
            held, total = found[i] if found else (0, 0)
            held = max(held, self._sent_prefix(rid, key.block_hashes))
            queued = max(self.load[rid], self.replica_queue_len_cache.get(rid) or 0)
            cost = key.num_tokens - held * key.block_size + self.load_tokens * queued
            # ties (no cache anywhere, equal load): the replica holding fewer blocks takes the new prefix
            scored.append((cost, total, rid.unique_id, replica))
        ranked = [row[-1] for row in sorted(scored, key=lambda row: row[:3])]
        self._track(pending_request.metadata.internal_request_id, ranked[0].replica_id, key.block_hashes)
        return [[replica] for replica in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        key = _routing_key(pending_request)
        if key is not None:
            self._track(pending_request.metadata.internal_request_id, replica_id, key.block_hashes)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._untrack(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.forget.remote([replica_id.unique_id])

    def _sent_prefix(self, replica_id: ReplicaID, block_hashes: tuple[bytes, ...]) -> int:
        sent = self.sent.get(replica_id)
        n = 0
        while sent and n < len(block_hashes) and sent[block_hashes[n]] > 0:
            n += 1
        return n

    def _track(self, request_id: str, replica_id: ReplicaID, block_hashes: tuple[bytes, ...]) -> None:
        self._untrack(request_id)
        self.in_flight[request_id] = (replica_id, block_hashes)
        self.sent.setdefault(replica_id, Counter()).update(block_hashes)
        self.load[replica_id] += 1

    def _untrack(self, request_id: str) -> None:
        found = self.in_flight.pop(request_id, None)
        if found is not None:
            replica_id, block_hashes = found
            sent = self.sent[replica_id]
            for block_hash in block_hashes:
                sent[block_hash] -= 1
                if not sent[block_hash]:
                    del sent[block_hash]
            self.load[replica_id] -= 1


def _routing_key(pending_request: PendingRequest | None) -> RoutingKey | None:
    if pending_request is None:
        return None
    # by its field, as Ray's routers read `prompt`: Serve may hand the router a copy of this module
    # (cloudpickled by value), whose RoutingKey is not the class the ingress made the key of
    return next((arg for arg in pending_request.args if hasattr(arg, "block_hashes")), None)
