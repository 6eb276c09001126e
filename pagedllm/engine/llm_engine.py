"""LLMEngine: requests in, one scheduled forward pass per step, RequestOutputs out.

A step reads as nano-vllm's: the scheduler picks the step's work, the model runner computes it, and
postprocessing turns the logits into each sequence's next token (the sampler's, or its beam search's
choice) and hands them to the scheduler, the one owner of what follows: appends, KV slots, stops, frees.
With speculative decoding the proposer then gives each decoding sequence draft tokens for the next
step, which verifies them (engine/speculative.py: n-gram lookup; engine/draft_model.py: a draft model).
"""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager

import torch

from pagedllm._runtime import apply_thread_count, keep_large_allocations
from pagedllm.engine import prompt_logprobs
from pagedllm.engine.beam_search import BeamSearchDriver, beam_sampling_params, beam_tokens
from pagedllm.engine.config import EngineConfig, parse_bytes
from pagedllm.engine.draft_model import DraftModelProposer
from pagedllm.engine.generation_config import sampling_defaults
from pagedllm.engine.guided import GrammarCompiler
from pagedllm.engine.kv_sizing import check_max_model_len, kv_block_bytes, model_kv_groups, num_kv_blocks
from pagedllm.engine.kv_store import DiskReader, DiskStore, kv_fingerprint
from pagedllm.engine.model_cache import load_shared_model
from pagedllm.engine.model_runner import ModelRunner, StepInputs, calibration_ids
from pagedllm.engine.op_profile import OpRecording, profile_ops
from pagedllm.engine.parallel.executor import Executor
from pagedllm.engine.parallel.runner import ParallelModelRunner
from pagedllm.engine.request import Request, check_prompt
from pagedllm.engine.run_info import RunInfo, read_run_info
from pagedllm.engine.sampler import Sample, SampleRow, sample
from pagedllm.engine.scheduler import Scheduler, SchedulerOutput
from pagedllm.engine.sequence import Sequence
from pagedllm.engine.speculative import NgramProposer, SpeculativeConfig, accepted_length
from pagedllm.engine.stats import STEP_PHASES, EngineStats, StepObserver, StepTrace
from pagedllm.engine.stop_checker import StopChecker
from pagedllm.kv import ContiguousAllocator, KVAllocator, PagedAllocator
from pagedllm.kv.events import KVEventLog
from pagedllm.kv.tiers import DISK, HOST, DiskTier, HostPool, PrefixTiers, TierMoves
from pagedllm.models.parallel import SINGLE
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)

PREFETCH_SEQS = 8  # waiting prompts whose disk-tier blocks are read ahead, each step


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        apply_thread_count()
        if torch.device(config.device).type == "cpu":
            keep_large_allocations()
        # Under tensor parallelism the other ranks start now and load their shards while this one does.
        self.executor = Executor(config) if config.is_parallel else None
        try:
            self._start(config)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, config: EngineConfig) -> None:
        tp = self.executor.tp if self.executor else SINGLE
        loaded = load_shared_model(
            config.model,
            config.torch_dtype,
            config.device,
            config.quantization,
            tp,
            config.max_num_seqs,
            config.max_model_len,
        )
        self.loaded_model, self.model, self.tokenizer = loaded, loaded.model, loaded.tokenizer
        self.weight_bytes = loaded.weight_bytes
        self.eos_token_ids = set(loaded.eos_token_ids)
        model_cfg = self.model.config
        self.max_model_len = check_max_model_len(config.max_model_len, model_cfg.max_position_embeddings)
        self.default_sampling = sampling_defaults(config.generation_config, loaded.path)
        self.grammars = GrammarCompiler(loaded.path, model_cfg.vocab_size, sorted(self.eos_token_ids))
        self.kv_groups = model_kv_groups(model_cfg, self.hybrid_kv_cache)
        # Rank 0 holds the most KV heads of any rank: its blocks are the largest.
        block_bytes = kv_block_bytes(
            model_cfg,
            self.model.num_kv_heads,
            config.kv_torch_dtype,
            config.block_size,
            self.kv_groups.layers_per_group,
        )
        self.num_kv_blocks = num_kv_blocks(config, block_bytes, self.weight_bytes)
        self.kv_cache_bytes = self.num_kv_blocks * block_bytes
        self.tiers = self._make_tiers(block_bytes) if config.has_kv_tiers else None
        self.allocator = self._make_allocator()
        logger.info(
            "weights %.1f MiB (%s), KV cache %.1f MiB: %d blocks of %d tokens (%d tokens, %s layout)",
            self.weight_bytes / 2**20,
            loaded.linear_method,
            self.kv_cache_bytes / 2**20,
            self.num_kv_blocks,
            config.block_size,
            self.num_kv_blocks * config.block_size,
            config.kv_layout,
        )
        # The runner's cache has the allocator's geometry (the contiguous layout: blocks of one slot).
        cache = (
            self.allocator.num_total_blocks,
            self.allocator.block_size,
            config.kv_torch_dtype,
            config.device,
        )
        if self.tiers is not None:  # the host tier's pool is the swap pool too
            num_host_blocks = self.tiers.host.num_blocks
        else:
            num_host_blocks = cache[0] if config.preemption_mode == "swap" else 0
        prefault, groups = config.prefault_kv_cache, self.kv_groups
        if self.executor:
            self.runner = ParallelModelRunner(
                self.executor, self.model, *cache, num_host_blocks, prefault, groups
            )
        else:
            self.runner = ModelRunner(self.model, *cache, num_host_blocks, prefault, groups)
        self.runner.calibrate_key_smoothing(calibration_ids(model_cfg.vocab_size, self.max_model_len))
        self.disk_store = self.disk_reader = None
        if self.tiers is not None:
            probe = min(8, num_host_blocks, self.num_kv_blocks)
            self.tiers.observe_load(HOST, self.runner.time_host_load(probe), probe)
            if config.kv_offload_dir is not None:
                self.disk_store = self._open_disk_store(block_bytes)
                self.disk_reader = DiskReader(self.disk_store)
        self.proposer = self._make_proposer(config.speculative_config)
        self.scheduler = Scheduler(
            self.allocator,
            self.max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            preemption_mode=config.preemption_mode,
            enable_chunked_prefill=config.enable_chunked_prefill,
            watermark=config.watermark,
            stop_checker=StopChecker(self.tokenizer, self.eos_token_ids, self.max_model_len),
            # A sequence that leaves the cache leaves the draft model's too.
            on_release=self.proposer.release if self.proposer is not None else None,
        )
        self.spec_verifies = self.spec_draft_tokens = self.spec_accepted_tokens = 0
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self._observers: list[StepObserver] = []
        self._snapshots = None  # the dashboard's KVSnapshots, made on first use

    @property
    def hybrid_kv_cache(self) -> bool:
        """Whether sliding-window layers hold only their window (KV groups): paged, and not disabled."""
        return self.config.kv_layout == "paged" and not self.config.disable_hybrid_kv_cache_manager

    def _make_proposer(self, spec: SpeculativeConfig | None) -> NgramProposer | DraftModelProposer | None:
        if spec is None:
            return None
        if spec.method == "ngram":
            return NgramProposer(spec)
        # Its pool: as many blocks as the target's (its own, smaller ones): it holds what the target does.
        return DraftModelProposer(spec, self.config, self.model.config.vocab_size, self.num_kv_blocks)

    def _make_allocator(self) -> KVAllocator:
        config = self.config
        if config.kv_layout == "paged":
            return PagedAllocator(
                self.num_kv_blocks,
                config.block_size,
                enable_prefix_caching=config.enable_prefix_caching,
                windows=self.kv_groups.windows,
                # Admission asks a prompt's first chunk: one block of new tokens (a window group's promise
                # adds its window: what it holds once it decodes); a longer chunk takes the free blocks the
                # scheduler finds for it (prefill_room).
                prefill_chunk=config.block_size if config.enable_chunked_prefill else None,
                tiers=self.tiers,
            )
        num_slots = self.num_kv_blocks * config.block_size
        return ContiguousAllocator(num_slots, self.max_model_len, reserve=config.contiguous_reserve)

    def _make_tiers(self, block_bytes: int) -> PrefixTiers:
        """The host tier (kv_offload_memory; a disk tier alone stages its reads in a pool the size of the
        KV cache) and the disk tier (kv_offload_dir, kv_offload_disk), sized in blocks."""
        config = self.config
        num_host = self.num_kv_blocks
        if config.kv_offload_memory is not None:
            num_host = parse_bytes(config.kv_offload_memory, "kv_offload_memory") // block_bytes
            if num_host < 1:
                raise ValueError(
                    f"kv_offload_memory={config.kv_offload_memory!r} holds no KV block ({block_bytes} bytes)"
                )
        disk = None
        if config.kv_offload_dir is not None:
            num_disk = parse_bytes(config.kv_offload_disk, "kv_offload_disk") // block_bytes
            if num_disk < 1:
                raise ValueError(
                    f"kv_offload_disk={config.kv_offload_disk!r} holds no KV block ({block_bytes} bytes)"
                )
            disk = DiskTier(num_disk)
        return PrefixTiers(HostPool(num_host), disk, config.block_size)

    def _open_disk_store(self, block_bytes: int) -> DiskStore:
        """The disk tier's folder for this model and these settings; the blocks already there (from an
        earlier process) join the tier, oldest first, as far as its size allows."""
        config, model_cfg = self.config, self.model.config
        settings = {
            "model": config.model,
            "dtype": str(config.torch_dtype),
            "kv_cache_dtype": str(config.kv_torch_dtype),
            "quantization": config.quantization,
            "linear_method": self.loaded_model.linear_method,
            "block_size": config.block_size,
            "layers": model_cfg.num_layers,
            "kv_heads": self.model.num_kv_heads,
            "head_dim": model_cfg.head_dim,
            "block_bytes": block_bytes,
            "layout": "per layer K then V, a block as [slot, kv_head, dim] (quantized: codes, then scales)",
        }
        fingerprint, described = kv_fingerprint(
            self.loaded_model.path, settings, self.runner.key_smoothing_bytes()
        )
        store = DiskStore(config.kv_offload_dir, fingerprint, described, block_bytes)
        for key in store.scan():
            for old in self.tiers.disk.add(key):
                store.delete(old)
        logger.info("disk tier %s: %d blocks found", store.folder, len(self.tiers.disk.keys))
        return store

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and the disk reader (if any); the engine cannot step after."""
        if self.executor is not None:
            self.executor.stop()
        if getattr(self, "disk_reader", None) is not None:  # None too when start-up failed before it
            self.disk_reader.close()

    @property
    def failure(self) -> str | None:
        """Why the engine can no longer step (a tensor-parallel rank died or hung), or None."""
        return self.executor.failure if self.executor is not None else None

    # -- requests ---------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | BeamSearchParams | None = None,
    ) -> None:
        """Queue a prompt; BeamSearchParams make it a beam search (one output per beam when done)."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids = check_prompt(
            request_id,
            prompt,
            params,
            tokenizer=self.tokenizer,
            vocab_size=self.model.config.vocab_size,
            max_model_len=self.max_model_len,
            model=self.config.model,
        )
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
        self.requests[request_id] = request
        self.scheduler.add(self._new_sequence(request))

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
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- one step ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, postprocess; report every request that changed (a beam search
        only once it is done)."""
        self.num_steps += 1
        clock = _PhaseClock()
        if self.disk_reader is not None:
            self._prefetch()
        out = self.scheduler.schedule()
        moves = self._tier_moves(out)
        clock.lap("schedule")
        context_tokens = sum(seq.num_cached_tokens for seq in out.scheduled)
        logits = self._run(out, clock) if out.scheduled else None
        if moves is not None:
            self._persist(moves)
        changed = self._postprocess(out, logits, clock)
        outputs = [self._output(request) for request in changed]
        clock.lap("rest")
        if self.proposer is not None:
            self._propose()
            clock.lap("propose")
        if self._observers:
            self._notify(out, clock.seconds, context_tokens)
        return outputs

    def _run(self, out: SchedulerOutput, clock: _PhaseClock) -> torch.Tensor:
        block_tables = [self.allocator.block_tables(seq.seq_id) for seq in out.scheduled]
        clock.lap("rest")
        inputs = self.runner.prepare_inputs(out, block_tables)
        clock.lap("inputs")
        logits = self.runner.execute_step(inputs)
        clock.lap("forward")
        if self.tiers is not None and 2 * (out.num_tokens - len(out.decodes)) >= out.num_tokens >= 32:
            self.tiers.observe_prefill(clock.seconds["forward"], out.num_tokens)  # a prefill-bound step
        if any(seq.needs_prompt_logprobs for seq in out.prefills):  # logits of prompt positions came too
            logits = self._gather_prompt_logprobs(out, inputs, logits)
            clock.lap("sample")
        return logits

    # -- prefix cache tiers -----------------------------------------------------------------------

    def _prefetch(self) -> None:
        """Land the disk reads that finished into host blocks, then start reads of the disk-tier blocks of
        the next waiting prompts (on the reader's thread); a prompt whose blocks are still being read waits
        in the queue (`Sequence.loading_kv`) while the others step. With nothing else to run, wait for one."""
        scheduler = self.scheduler
        idle = not scheduler.running and not scheduler.swapped
        idle = idle and not any(seq.admissible for seq in scheduler.waiting)
        for done in self.disk_reader.finished(block=idle):
            good = [(slot, data) for (_, slot), data in zip(done.reads, done.payloads, strict=True) if data]
            if good:
                rows = torch.frombuffer(bytearray(b"".join(data for _, data in good)), dtype=torch.uint8)
                self.runner.write_host_blocks([slot for slot, _ in good], rows.view(len(good), -1))
            self.tiers.observe_load(DISK, done.seconds, len(done.reads))
            self.tiers.prefetched(done.reads, [data is not None for data in done.payloads])
        for i, seq in enumerate(scheduler.waiting):
            if i >= PREFETCH_SEQS or seq.awaiting or seq.needs_prompt_logprobs:
                seq.loading_kv = False
                continue
            plan = self.allocator.plan_prefetch(seq.token_ids)
            if plan.reads:
                self.disk_reader.submit(plan.reads)
            seq.loading_kv = plan.pending

    def _tier_moves(self, out: SchedulerOutput) -> TierMoves | None:
        """The tiers' copies planned since the last step: evicted blocks to host memory go with the swap-
        outs, host-tier hits into device blocks with the swap-ins (made now if no forward runs)."""
        if self.tiers is None:
            return None
        moves = self.tiers.take_moves()
        out.swap_out += moves.offload
        out.swap_in += moves.load
        if not out.scheduled and (moves.offload or moves.load):
            self.runner.move_blocks(moves.offload, moves.load, [])
        return moves

    def _persist(self, moves: TierMoves) -> None:
        """After the forward computed them: write the newly cached blocks to the disk tier's files, delete
        those it evicted (a disk that fails a write loses that block from the tier, nothing else)."""
        if self.disk_store is None:
            return
        disk = self.tiers.disk
        keep = [(block, key) for block, key in moves.persist if key in disk]
        if keep:
            rows = self.runner.read_device_blocks([block for block, _ in keep]).numpy()
            for (_, key), row in zip(keep, rows, strict=True):
                try:
                    self.disk_store.write(key, row.tobytes())
                except OSError as error:
                    logger.warning("disk tier: block not written (%s)", error)
                    disk.forget(key)
        for key in moves.drop:
            if key not in disk:
                self.disk_store.delete(key)

    def _gather_prompt_logprobs(
        self, out: SchedulerOutput, inputs: StepInputs, logits: torch.Tensor
    ) -> torch.Tensor:
        """Take the prompt log-probabilities out of the step's logits (each sequence's last
        inputs.num_logits rows); returns each scheduled sequence's last row, which its next token needs."""
        ends = inputs.num_logits.cumsum()
        for seq, end, count in zip(out.scheduled, ends.tolist(), inputs.num_logits.tolist(), strict=True):
            cached = seq.num_cached_tokens
            wanted = prompt_logprobs.wanted_positions(seq, cached - out.num_new_tokens[seq.seq_id], cached)
            if wanted:
                prompt_logprobs.gather(seq, wanted, logits[end - count : end])
        if len(logits) == len(ends):
            return logits
        return logits[torch.from_numpy(ends - 1).to(logits.device)]

    def _postprocess(
        self, out: SchedulerOutput, logits: torch.Tensor | None, clock: _PhaseClock
    ) -> list[Request]:
        """The step's new tokens, sampled or chosen by beam searches, go to the scheduler. Returns the
        requests that changed (a beam search only once it is done)."""
        new_tokens = []
        for seq in out.ignored:  # finished by the scheduler: they can never fit the cache
            search = self.requests[seq.request_id].beam_search
            if search is not None:  # the search goes on without the beam (which may end its round)
                new_tokens += search.drop(seq)
        ready = [seq for _, seq in out.ready()] if logits is not None else []
        if ready:
            new_tokens += self._next_tokens(out, logits, clock)
        for seq in self.scheduler.update_from_output(new_tokens):
            search = self.requests[seq.request_id].beam_search
            if search is not None:  # a beam outgrew the cache (it cannot end a round: all just moved)
                search.drop(seq)
        changed = [*out.ignored, *ready, *(seq for seq, _ in new_tokens)]  # the last: n > 1 forks too
        requests = {seq.request_id: self.requests[seq.request_id] for seq in changed}
        return [request for request in requests.values() if request.beam_search is None or request.finished]

    def _next_tokens(
        self, out: SchedulerOutput, logits: torch.Tensor, clock: _PhaseClock
    ) -> list[tuple[Sequence, Sample]]:
        """Each computed sequence's next token: sampled (an n > 1 request's siblings are forked at its
        first and sample from the same logits), or, for a beam, its search's once the round is complete."""
        rows, seqs, beams = [], [], []
        for row, seq in out.ready():
            search = self.requests[seq.request_id].beam_search
            if search is None:
                rows.append(row)
                seqs.append(seq)
            else:
                beams.append((row, seq, search))
        for row, seq in list(zip(rows, seqs, strict=True)):
            for child in self.requests[seq.request_id].fork_samples(seq, self.fork):
                rows.append(row)
                seqs.append(child)
        new_tokens = []
        if seqs:
            # A sequence with k draft tokens has k + 1 rows: row i verifies draft i (the last: the next).
            picked_rows, sample_rows = [], []
            for row, seq in zip(rows, seqs, strict=True):
                drafts = seq.draft_token_ids
                for i in range(len(drafts) + 1):
                    picked_rows.append(row + i)
                    draft = drafts[i] if i < len(drafts) else None
                    q = seq.draft_probs[i] if draft is not None and seq.draft_probs is not None else None
                    sample_rows.append(self._sample_row(seq, drafts[:i], draft, q))
            all_rows = picked_rows == list(range(len(logits)))
            picked = logits if all_rows else logits[picked_rows]  # all: no copy
            clock.lap("rest")
            samples = iter(sample(picked, sample_rows))
            for seq in seqs:
                run = [next(samples) for _ in range(len(seq.draft_token_ids) + 1)]
                num_new = accepted_length([smp.token_id for smp in run], seq.draft_token_ids)
                if seq.draft_token_ids:
                    self.spec_verifies += 1
                    self.spec_draft_tokens += len(seq.draft_token_ids)
                    self.spec_accepted_tokens += num_new - 1
                new_tokens += [(seq, smp) for smp in run[:num_new]]
            clock.lap("sample")
        if beams:
            beam_logits = logits[[row for row, _, _ in beams]]
            new_tokens += beam_tokens(beam_logits, [(seq, search) for _, seq, search in beams])
        return new_tokens

    def _sample_row(
        self,
        seq: Sequence,
        accepted: list[int] | None = None,
        draft: int | None = None,
        draft_probs: torch.Tensor | None = None,
    ) -> SampleRow:
        """What the sampler needs for seq's next token; for a verify pass's row, the next token after the
        drafts before it (`accepted`, as if already sampled), checking `draft` (drawn from `draft_probs`)."""
        params = seq.params
        output = seq.output_token_ids + accepted if accepted else seq.output_token_ids
        banned: tuple[int, ...] = ()
        if len(output) < params.min_tokens:
            banned = tuple(params.stop_token_ids) + (() if params.ignore_eos else tuple(self.eos_token_ids))
        generator = self.requests[seq.request_id].generator
        return SampleRow(
            params,
            generator,
            banned,
            seq.prompt_token_ids,
            output,
            guide=seq.guide,
            draft_token_id=draft,
            draft_probs=draft_probs,
        )

    def _propose(self) -> None:
        """Draft tokens for each running sequence that decodes next step (not a beam, not guided: their
        next tokens depend on more than the logits), at most one fewer than it may still generate."""
        seqs = [
            seq
            for seq in self.scheduler.running
            if seq.num_tokens - seq.num_cached_tokens == 1
            and seq.guide is None
            and self.requests[seq.request_id].beam_search is None
        ]
        rooms = [seq.max_new_tokens(self.max_model_len) - 1 for seq in seqs]
        generators = [self.requests[seq.request_id].generator for seq in seqs]
        for seq, draft in zip(seqs, self.proposer.propose_batch(seqs, rooms, generators), strict=True):
            seq.draft_token_ids, seq.draft_probs = draft.token_ids, draft.probs

    def _output(self, request: Request) -> RequestOutput:
        output = request.output(self.tokenizer)
        if output.finished:
            del self.requests[request.request_id]
        return output

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
            spec_verifies=self.spec_verifies,
            spec_draft_tokens=self.spec_draft_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens,
            kv_tiers=self.tiers.usage() if self.tiers is not None else None,
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
