"""LLMEngine: requests in, one scheduled forward pass per step, RequestOutputs out.

A step reads as nano-vllm's: the scheduler plans the step (which tokens, which block tables, which block
copies), the model runner computes it, and the postprocessor (engine/postprocess.py) turns the logits
into each sequence's next token and hands them to the scheduler, the one owner of what follows: appends,
KV slots, stops, frees. With speculative decoding the proposer then gives each decoding sequence draft
tokens for the next step, which verifies them (engine/speculative.py: n-gram lookup; engine/draft_model.py:
a draft model). The engine is built by engine/build.py; the prefix cache tiers' byte moves are
engine/kv_transfer.py's.

A step either completes or fails as a whole: what it made findable in the prefix cache is committed only
once its forward pass and postprocessing ran (`KVAllocator.commit`). If anything in it raises, the
allocator rolls the step back (no block, tier entry or KV event of it survives), every request holding KV
blocks ends (finish_reason "error", gone from the engine, its blocks back in the pool), and `step()`
raises the step's exception; the engine goes on serving the waiting requests and the next ones. Only if
that clean-up itself fails is the engine broken for good (`failure` says why).
"""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager

import torch

from pagedllm._runtime import apply_thread_count, keep_large_allocations
from pagedllm.engine import build
from pagedllm.engine.beam_search import BeamSearchDriver, beam_sampling_params
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.kv_sizing import check_fits_cache
from pagedllm.engine.lora_manager import LoRAManager
from pagedllm.engine.op_profile import OpRecording, profile_ops
from pagedllm.engine.parallel.executor import Executor
from pagedllm.engine.postprocess import Postprocessor
from pagedllm.engine.request import Request, check_prompt
from pagedllm.engine.run_info import RunInfo, read_run_info
from pagedllm.engine.scheduler import SchedulerOutput
from pagedllm.engine.sequence import Sequence, SequenceStatus
from pagedllm.engine.speculative import propose_drafts
from pagedllm.engine.stats import STEP_PHASES, EngineStats, StepObserver, StepTrace
from pagedllm.kv import PagedAllocator
from pagedllm.kv.events import KVEventLog
from pagedllm.lora_request import LoRARequest
from pagedllm.models.loader import resolve_model
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        apply_thread_count()
        if torch.device(config.device).type == "cpu":
            keep_large_allocations()
        # Under tensor parallelism the other ranks start now and load their shards while this one does.
        model = resolve_model(config.model)  # the one place the model's name is resolved
        self.executor = Executor(config, model) if config.is_parallel else None
        self.transfers = None
        self._broken: str | None = None  # why the engine cannot step any more, if a rollback failed
        try:
            build.build(self, config, model)
        except BaseException:
            self.shutdown()
            raise
        self.requests: dict[str, Request] = {}
        self.postprocessor = Postprocessor(self.requests, self.scheduler, self.eos_token_ids, self.fork)
        self.num_steps = 0
        self._observers: list[StepObserver] = []
        self._snapshots = None  # the dashboard's KVSnapshots, made on first use

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and the disk reader (if any); the engine cannot step after."""
        if self.executor is not None:
            self.executor.stop()
        if self.transfers is not None:
            self.transfers.close()

    @property
    def failure(self) -> str | None:
        """Why the engine can no longer step (a tensor-parallel rank died or hung, a rollback failed), or
        None."""
        if self._broken is not None:
            return self._broken
        return self.executor.failure if self.executor is not None else None

    # -- requests ---------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | BeamSearchParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a prompt; BeamSearchParams make it a beam search (one output per beam when done);
        `lora_request`: the LoRA adapter it runs under (loaded now if it is not in memory)."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if lora_request is not None:
            self._loras(f"lora_request {lora_request.lora_name!r}")
        text, token_ids = check_prompt(
            request_id,
            prompt,
            params,
            tokenizer=self.tokenizer,
            vocab_size=self.model.config.vocab_size,
            max_model_len=self.max_model_len,
            model=self.config.model,
        )
        check_fits_cache(token_ids, self.allocator, self.config)
        if isinstance(params, BeamSearchParams):
            request = Request(request_id, text, token_ids, beam_sampling_params(params))
            max_new_tokens = min(params.max_tokens, self.max_model_len - len(token_ids))
            request.beam_search = BeamSearchDriver(
                params, self.eos_token_ids, max_new_tokens, request.seqs, self.fork, self.scheduler.finish
            )
        else:
            if params.guided_decoding is not None:
                self.grammars.compile(
                    params.guided_decoding
                )  # a bad schema fails here; cached for its guides
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.config.device).manual_seed(params.seed)
            request = Request(request_id, text, token_ids, params, generator)
        if lora_request is not None:
            self.loras.acquire(lora_request)  # a bad adapter fails here, before the request is queued
            request.lora_request = lora_request
        self.requests[request_id] = request
        self.scheduler.add(self._new_sequence(request))

    def add_lora(self, lora: LoRARequest) -> None:
        """Load an adapter ahead of its requests (vLLM's add_lora); ValueError if it cannot be served."""
        self._loras(f"adapter {lora.lora_name!r}").preload(lora)

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget an adapter: out of memory now, or when its last running request ends."""
        self._loras(f"lora_int_id={lora_int_id}").remove(lora_int_id)

    def _loras(self, what: str) -> LoRAManager:
        if self.loras is None:
            raise ValueError(f"{what} needs an engine with enable_lora=True")
        return self.loras

    def fork(self, parent: Sequence) -> Sequence:
        """A new sequence of parent's request continuing from parent's tokens, sharing its KV blocks
        copy-on-write (a contiguous slab is copied): the one primitive n-sampling and beam search need."""
        child = self._new_sequence(self.requests[parent.request_id], parent)
        self.scheduler.fork(parent, child)
        return child

    def _new_sequence(self, request: Request, parent: Sequence | None = None) -> Sequence:
        guided = request.params.guided_decoding
        return request.new_sequence(parent, self.grammars.guide(guided) if guided is not None else None)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its KV blocks return to the pool."""
        request = self.requests.get(request_id)
        if request is None:
            return
        self._forget(request)
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- one step ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, postprocess; report every request that changed (a beam search
        only once it is done). If it fails, it is rolled back, the requests holding KV are ended, and its
        exception is raised."""
        if self._broken is not None:
            raise RuntimeError(self._broken)
        self.num_steps += 1
        clock = _PhaseClock()
        if self.transfers is not None:
            self.transfers.prefetch(self.scheduler, self.allocator)
        try:
            out = self.scheduler.schedule()
            clock.lap("schedule")
            context_tokens = sum(seq.num_cached_tokens for seq in out.scheduled)
            logits = self._run(out, clock)
            changed = self.postprocessor.process(out, logits, clock.lap)
            if self.transfers is not None:
                self.transfers.persist(out.tier_moves)
            if self.proposer is not None:
                clock.lap("rest")
                propose_drafts(self.proposer, self.scheduler.running, self.requests, self.max_model_len)
                clock.lap("propose")
            self.allocator.commit()
        except Exception:
            self._fail_step()
            raise
        outputs = [self._output(request) for request in changed]
        clock.lap("rest")
        if self._observers:
            self._notify(out, clock.seconds, context_tokens)
        return outputs

    def _run(self, out: SchedulerOutput, clock: _PhaseClock) -> torch.Tensor | None:
        """The step's forward pass (block moves first); only the moves when nothing is scheduled."""
        if not out.scheduled:
            if out.swap_out or out.swap_in or out.copies:
                self.runner.move_blocks(out.swap_out, out.swap_in, out.copies)
            return None
        inputs = self.runner.prepare_inputs(out, out.block_tables)
        clock.lap("inputs")
        logits = self.runner.execute_step(inputs)
        clock.lap("forward")
        if self.tiers is not None and 2 * (out.num_tokens - len(out.decodes)) >= out.num_tokens >= 32:
            self.tiers.observe_prefill(clock.seconds["forward"], out.num_tokens)  # a prefill-bound step
        if any(seq.needs_prompt_logprobs for seq in out.prefills):  # logits of prompt positions came too
            logits = self.postprocessor.gather_prompt_logprobs(out, inputs.num_logits, logits)
            clock.lap("sample")
        return logits

    def _fail_step(self) -> None:
        """Roll the failed step back and end every request whose KV it may have touched: each one holding
        blocks (running, swapped, or admitted part way). Waiting requests holding none go on."""
        logger.exception("engine step %d failed: rolling it back", self.num_steps)
        try:
            self.allocator.rollback()
            failed = [request for request in self.requests.values() if self._holds_kv(request)]
            self.scheduler.fail([seq for request in failed for seq in request.seqs])
            for request in failed:
                self._forget(request)
        except Exception as error:
            self._broken = f"a failed step could not be rolled back ({type(error).__name__}: {error})"
            raise

    def _holds_kv(self, request: Request) -> bool:
        return any(
            seq.seq_id in self.allocator or seq.status is SequenceStatus.RUNNING for seq in request.seqs
        )

    def _output(self, request: Request) -> RequestOutput:
        output = request.output(self.tokenizer)
        if output.finished:
            self._forget(request)
        return output

    def _forget(self, request: Request) -> None:
        """The request is done (finished, aborted, failed): it leaves the engine, lets go of its adapter."""
        del self.requests[request.request_id]
        if request.lora_request is not None:
            self.loras.release(request.lora_request.lora_int_id)

    def _notify(self, out: SchedulerOutput, seconds: dict[str, float], context_tokens: int) -> None:
        prefill_tokens = sum(out.num_new_tokens[seq.seq_id] for seq in out.prefills)
        trace = StepTrace(self.num_steps, seconds, prefill_tokens, len(out.decodes), context_tokens)
        for observer in self._observers:
            observer(trace)

    # -- the engine's face: what callers read between steps ---------------------------------------

    def add_step_observer(self, observer: StepObserver) -> None:
        """Call `observer(trace)` after every step from now on (profiling, pictures, benchmarks)."""
        self._observers.append(observer)

    def remove_step_observer(self, observer: StepObserver) -> None:
        self._observers.remove(observer)

    def enable_kv_events(self) -> KVEventLog:
        """Log the prefix cache's changes from now on as vLLM's KV cache events (kv/events.py: drain them
        from any thread); the paged layout with prefix caching only."""
        if not isinstance(self.allocator, PagedAllocator):
            raise ValueError(f"KV cache events need kv_layout='paged', got {self.config.kv_layout!r}")
        return self.allocator.enable_events()

    def profile_ops(self) -> AbstractContextManager[OpRecording]:
        """Profile the steps run inside the block, op by op: `with engine.profile_ops() as rec: ...`, then
        `rec.result` (engine/op_profile.py: matmuls by weight kind, attention, phases). Costs nothing
        while unused."""
        return profile_ops(self)

    def stats(self) -> EngineStats:
        """Queues, counters and KV usage now (call between steps, on the thread that steps)."""
        scheduler = self.scheduler
        return EngineStats(
            num_steps=self.num_steps,
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_swapped=len(scheduler.swapped),
            num_preemptions=scheduler.num_preemptions,
            prefix_cache_queries=scheduler.prefix_cache_queries,
            prefix_cache_hits=scheduler.prefix_cache_hits,
            num_blocks_swapped_out=scheduler.num_blocks_swapped_out,
            num_blocks_swapped_in=scheduler.num_blocks_swapped_in,
            kv_usage=self.allocator.usage(),
            kv_all_free=self.allocator.all_free() and (self.proposer is None or self.proposer.all_free()),
            spec_verifies=self.postprocessor.spec.verifies,
            spec_draft_tokens=self.postprocessor.spec.draft_tokens,
            spec_accepted_tokens=self.postprocessor.spec.accepted_tokens,
            kv_tiers=self.tiers.usage() if self.tiers is not None else None,
            lora_bytes=None if self.loras is None else {m.name: m.nbytes for m in self.loras.loaded.values()},
        )

    def kv_snapshot(self) -> dict:
        """The KV cache as the dashboard draws it (`GET /v1/kv`): usage, queues, counters, the block map
        and each resident sequence's block table; call between steps."""
        if self._snapshots is None:
            from pagedllm.engine.kv_snapshot import KVSnapshots

            self._snapshots = KVSnapshots(self)
        return self._snapshots.take()

    def unfinished_request_ids(self) -> list[str]:
        """Requests added and not yet finished or aborted, in the order they were added."""
        return list(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def layer_kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (K, V) cache view on this process, its quantized K cache's key smoothing included
        (ops/kv_cache.py): what a bench that runs the model outside the engine copies the smoothing from."""
        return list(self.runner.kv_caches)

    def comm_stats(self) -> list | None:
        """Tensor parallelism: each collective's calls and seconds so far (None on one process)."""
        return self.executor.comm_stats() if self.executor is not None else None

    def run_info(self) -> RunInfo:
        """What runs: sizes, KV geometry, attention backend, CPU build, linear method per weight type,
        threads (engine/run_info.py; the benchmarks print it in every row)."""
        return read_run_info(self)


class _PhaseClock:
    """Adds the wall time since the previous lap to a phase of the step."""

    def __init__(self):
        self.seconds = dict.fromkeys(STEP_PHASES, 0.0)
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now
