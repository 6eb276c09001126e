"""LLMEngine: requests in, one scheduled forward pass per step, RequestOutputs out."""

from __future__ import annotations

import logging
import os
import time
import weakref
from dataclasses import dataclass, field

import torch

from pagedllm import ops
from pagedllm._runtime import apply_thread_count, keep_large_allocations
from pagedllm.engine import detokenizer
from pagedllm.engine.beam_search import BeamSearch, Continuation
from pagedllm.engine.config import EngineConfig, parse_bytes
from pagedllm.engine.generation_config import sampling_defaults
from pagedllm.engine.guided import GrammarCompiler
from pagedllm.engine.model_runner import ModelRunner
from pagedllm.engine.parallel.executor import Executor
from pagedllm.engine.parallel.runner import ParallelModelRunner
from pagedllm.engine.sampler import SampleRow, sample
from pagedllm.engine.scheduler import Scheduler, SchedulerOutput
from pagedllm.engine.sequence import Sequence
from pagedllm.engine.stats import STEP_PHASES, EngineStats, StepObserver, StepTrace
from pagedllm.kv import ContiguousAllocator, PagedAllocator
from pagedllm.models import LoadedModel, ModelConfig, load_model
from pagedllm.models.linear import few_rows
from pagedllm.models.parallel import SINGLE, TensorParallel
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)

# Engines in one process share a loaded model (weights are read-only; each engine owns its KV cache).
_loaded_models: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def load_shared_model(
    model: str,
    dtype: torch.dtype,
    device: str,
    quantization: str | None = "auto",
    tp: TensorParallel = SINGLE,
    max_num_seqs: int | None = None,
) -> LoadedModel:
    """load_model, reusing a model another live engine already loaded with the same settings (a shard of a
    tensor-parallel group is its engine's own: its layers collect through that group)."""
    if tp.size > 1:
        return load_model(model, dtype, device, quantization=quantization, tp=tp, max_num_seqs=max_num_seqs)
    key = (model, dtype, device, quantization, few_rows(max_num_seqs))
    loaded = _loaded_models.get(key)
    if loaded is None:
        loaded = load_model(
            model, dtype=dtype, device=device, quantization=quantization, max_num_seqs=max_num_seqs
        )
        _loaded_models[key] = loaded
    return loaded


def kv_block_bytes(config: ModelConfig, num_kv_heads: int, dtype: torch.dtype, block_size: int) -> int:
    """Bytes of a KV block of `block_size` tokens for `num_kv_heads` heads of every layer (K and V; a
    quantized cache's scales included)."""
    return 2 * config.num_layers * ops.kv_block_bytes(block_size, num_kv_heads, config.head_dim, dtype)


@dataclass
class Request:
    """A prompt and the sequences generated from it: its n samples, or the running beams of a search."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    generator: torch.Generator | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    num_created: int = 0  # sequences created so far (each gets the next index)
    first_seq: Sequence | None = None  # the prompt's own sequence (the scheduler counts its cache hits)
    beam_search: BeamSearch | None = None
    # Beam search: the best next tokens of each running beam computed this round, by seq_id.
    beam_tops: dict[str, tuple[list[float], list[int]]] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        if self.beam_search is not None:
            return self.beam_search.done
        return len(self.seqs) == self.params.n and all(seq.is_finished for seq in self.seqs)


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
            config.model, config.torch_dtype, config.device, config.quantization, tp, config.max_num_seqs
        )
        self.loaded_model = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = set(loaded.eos_token_ids)
        model_cfg = self.model.config
        self.max_model_len = self._check_max_model_len(
            config.max_model_len, model_cfg.max_position_embeddings
        )
        self.default_sampling = sampling_defaults(config.generation_config, loaded.path)
        self.grammars = GrammarCompiler(loaded.path, model_cfg.vocab_size, sorted(self.eos_token_ids))
        num_blocks = config.num_kv_blocks or self._blocks_that_fit(self._kv_budget())
        self.num_kv_blocks = num_blocks
        self.weight_bytes = loaded.weight_bytes
        self.kv_cache_bytes = num_blocks * self._block_bytes()
        if config.kv_layout == "paged":
            self.allocator = PagedAllocator(
                num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
            )
            cache_blocks, cache_block_size = num_blocks, config.block_size
        else:
            num_slots = num_blocks * config.block_size
            self.allocator = ContiguousAllocator(
                num_slots, self.max_model_len, reserve=config.contiguous_reserve
            )
            cache_blocks, cache_block_size = num_slots, 1
        logger.info(
            "weights %.1f MiB (%s), KV cache %.1f MiB: %d blocks of %d tokens (%d tokens, %s layout)",
            self.weight_bytes / 2**20,
            loaded.linear_method,
            self.kv_cache_bytes / 2**20,
            num_blocks,
            config.block_size,
            num_blocks * config.block_size,
            config.kv_layout,
        )
        cache = (cache_blocks, cache_block_size, config.kv_torch_dtype, config.device)
        num_host_blocks = cache_blocks if config.preemption_mode == "swap" else 0
        prefault = config.prefault_kv_cache
        if self.executor:
            self.runner = ParallelModelRunner(self.executor, self.model, *cache, num_host_blocks, prefault)
        else:
            self.runner = ModelRunner(self.model, *cache, num_host_blocks, prefault)
        self.scheduler = Scheduler(
            self.allocator,
            self.max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            preemption_mode=config.preemption_mode,
            enable_chunked_prefill=config.enable_chunked_prefill,
            watermark=config.watermark,
        )
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self._observers: list[StepObserver] = []
        self._snapshots = None  # the dashboard's KVSnapshots, made on first use

    @staticmethod
    def _check_max_model_len(requested: int | None, context: int) -> int:
        """The model's context unless asked for less; more is refused, as vLLM does, unless allowed."""
        if requested is None:
            return context
        if requested > context and os.environ.get("PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN") != "1":
            raise ValueError(
                f"max_model_len={requested} is longer than the model's context of {context} tokens "
                "(max_position_embeddings): positions past it were never trained and give poor output. "
                "Set PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN=1 to allow it anyway"
            )
        return requested

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (if any); the engine cannot step afterwards."""
        if self.executor is not None:
            self.executor.stop()

    @property
    def failure(self) -> str | None:
        """Why the engine can no longer step (a tensor-parallel rank died or hung), or None."""
        return self.executor.failure if self.executor is not None else None

    def _block_bytes(self) -> int:
        """Bytes of one KV block on this rank (rank 0 holds the most KV heads of any rank)."""
        model, config = self.model, self.config
        return kv_block_bytes(model.config, model.num_kv_heads, config.kv_torch_dtype, config.block_size)

    def _kv_budget(self) -> int:
        """Bytes for the KV cache: kv_cache_memory, or what the weights leave of memory_budget."""
        config = self.config
        if config.memory_budget is None:
            return parse_bytes(config.kv_cache_memory)
        budget = parse_bytes(config.memory_budget, "memory_budget")
        weights = self.loaded_model.weight_bytes
        if budget <= weights:
            raise ValueError(
                f"memory_budget={config.memory_budget!r} ({budget / 2**20:.1f} MiB) leaves nothing for the "
                f"KV cache: the weights take {weights / 2**20:.1f} MiB"
            )
        return budget - weights

    def _blocks_that_fit(self, num_bytes: int) -> int:
        num_blocks = num_bytes // self._block_bytes()
        if num_blocks < 1:
            setting = "memory_budget" if self.config.memory_budget is not None else "kv_cache_memory"
            raise ValueError(f"{setting}={getattr(self.config, setting)!r} holds no KV block")
        return num_blocks

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
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"model {self.config.model!r} has no tokenizer: pass prompt token ids")
            # With the tokenizer's special tokens (e.g. Gemma's BOS), as vLLM encodes a text prompt.
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        vocab = self.model.config.vocab_size
        if not token_ids:
            raise ValueError(f"prompt is empty (request {request_id!r})")
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is out of range [0, {vocab})")
        bad = [t for t in getattr(params, "stop_token_ids", ()) if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"stop_token_ids holds {bad[0]!r}, out of the vocabulary's range [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; max_model_len={self.max_model_len} leaves no room "
                "to generate"
            )
        search = None
        if isinstance(params, BeamSearchParams):
            max_new_tokens = min(params.max_tokens, self.max_model_len - len(token_ids))
            search = BeamSearch(params, self.eos_token_ids, max_new_tokens)
            # What the scheduler reads of each beam: its length limit. Stops are the search's business.
            params = SamplingParams(
                max_tokens=params.max_tokens,
                temperature=0.0,
                ignore_eos=True,
                skip_special_tokens=params.skip_special_tokens,
            )
        if params.guided_decoding is not None:
            self.grammars.compile(params.guided_decoding)  # a bad schema fails here; cached for its guides
        request = Request(request_id, text, token_ids, params, beam_search=search)
        if params.seed is not None:
            request.generator = torch.Generator(device=self.config.device).manual_seed(params.seed)
        self.requests[request_id] = request
        request.first_seq = self._new_sequence(request)
        request.first_seq.arrival_step = self.num_steps
        self.scheduler.add(request.first_seq)

    def _new_sequence(self, request: Request, parent: Sequence | None = None) -> Sequence:
        """The request's next sequence: its prompt alone, or a copy of `parent`'s tokens so far."""
        index = request.num_created
        request.num_created += 1
        seq = Sequence(
            f"{request.request_id}#{index}",
            request.request_id,
            index,
            request.prompt_token_ids,
            request.params,
        )
        if parent is not None:
            seq.output_token_ids = list(parent.output_token_ids)
            seq.cumulative_logprob = parent.cumulative_logprob
        detokenizer.start(seq)
        if request.params.guided_decoding is not None:
            seq.guide = self.grammars.guide(request.params.guided_decoding)
        request.seqs.append(seq)
        return seq

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
        """Schedule, run one forward pass, sample, and report every request that changed (a beam
        search only once it is done)."""
        self.num_steps += 1
        clock = _PhaseClock()
        out = self.scheduler.schedule()
        clock.lap("schedule")
        touched: dict[str, Request] = {}
        for seq in out.ignored:
            seq.finish_reason = "length"
            self.scheduler.finish(seq)
            request = self.requests[seq.request_id]
            if request.beam_search is None:
                touched[seq.request_id] = request
            else:  # the beam can never fit the cache: the search goes on without it
                request.seqs.remove(seq)
                request.beam_tops.pop(seq.seq_id, None)
                if self._advance_beams(request):
                    touched[seq.request_id] = request
        context_tokens = sum(s.num_cached_tokens + out.num_new_tokens[s.seq_id] for s in out.scheduled)
        if out.scheduled:
            block_tables = [self.allocator.block_table(seq.seq_id) for seq in out.scheduled]
            clock.lap("rest")
            inputs = self.runner.prepare_inputs(out, block_tables)
            clock.lap("inputs")
            logits = self.runner.execute_step(inputs)
            clock.lap("forward")
            ready = self.scheduler.update_after_step(out)  # rows of sequences that need a next token
            rows, beams = [], []
            for row in ready:
                searching = self.requests[out.scheduled[row].request_id].beam_search is not None
                (beams if searching else rows).append(row)
            seqs, rows = self._fork_parallel_samples([out.scheduled[row] for row in rows], rows)
            if seqs:
                picked = logits if rows == list(range(len(logits))) else logits[rows]  # all: no copy
                clock.lap("rest")
                samples = sample(picked, [self._sample_row(seq) for seq in seqs])
                clock.lap("sample")
                for seq, smp in zip(seqs, samples, strict=True):
                    self._append_token(seq, smp)
                    touched[seq.request_id] = self.requests[seq.request_id]
            if beams:
                touched.update(self._step_beams(logits[beams], [out.scheduled[row] for row in beams]))
        outputs = [self._request_output(r) for r in touched.values()]
        clock.lap("rest")
        if self._observers:
            self._notify(out, clock.seconds, context_tokens)
        return outputs

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
            kv_all_free=self.allocator.all_free(),
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

    def comm_stats(self) -> list | None:
        """Tensor parallelism: each collective's calls and seconds so far (None on one process)."""
        return self.executor.comm_stats() if self.executor is not None else None

    def _fork_parallel_samples(
        self, seqs: list[Sequence], rows: list[int]
    ) -> tuple[list[Sequence], list[int]]:
        """After a request's first prefill, fork its other n-1 sequences sharing the prompt's blocks."""
        for row, seq in zip(list(rows), list(seqs), strict=True):
            request = self.requests[seq.request_id]
            if len(request.seqs) < request.params.n and seq.index == 0:
                for _ in range(1, request.params.n):
                    child = self._new_sequence(request)
                    self.scheduler.fork(seq, child)
                    seqs.append(child)
                    rows.append(row)
        return seqs, rows

    # -- beam search ------------------------------------------------------------------------------

    def _step_beams(self, logits: torch.Tensor, seqs: list[Sequence]) -> dict[str, Request]:
        """Keep each computed beam's best next tokens; advance every search whose running beams all
        have theirs (a preempted beam may be a step behind its siblings). Returns the searches done."""
        width = max(self.requests[seq.request_id].beam_search.num_candidates for seq in seqs)
        logprobs, token_ids = logits.log_softmax(dim=-1).topk(width)
        advanced: dict[str, Request] = {}
        for seq, lps, ids in zip(seqs, logprobs.tolist(), token_ids.tolist(), strict=True):
            request = self.requests[seq.request_id]
            num = request.beam_search.num_candidates
            request.beam_tops[seq.seq_id] = (lps[:num], ids[:num])
            seq.awaiting = True
            advanced[request.request_id] = request
        return {rid: request for rid, request in advanced.items() if self._advance_beams(request)}

    def _advance_beams(self, request: Request) -> bool:
        """Run the search's next step once every running beam is computed; returns whether it is done."""
        beams, search = list(request.seqs), request.beam_search
        if not beams:  # every beam was dropped: nothing left to search
            search.done = True
        elif all(seq.seq_id in request.beam_tops for seq in beams):
            tops = [request.beam_tops.pop(seq.seq_id) for seq in beams]
            chosen = search.step([(seq.output_token_ids, seq.cumulative_logprob) for seq in beams], tops)
            request.seqs = self._extend_beams(request, beams, chosen)
        return search.done

    def _extend_beams(
        self, request: Request, beams: list[Sequence], chosen: list[Continuation]
    ) -> list[Sequence]:
        """Each chosen continuation extends its parent beam: a parent chosen again is forked first (the
        copy shares its blocks copy-on-write); a beam not chosen is pruned and its blocks freed at once."""
        extended: list[Sequence] = []
        kept: set[int] = set()
        for c in chosen:
            parent = beams[c.parent]
            if c.parent in kept:
                child = self._new_sequence(request, parent)
                self.scheduler.fork(parent, child)
                extended.append(child)
            else:
                kept.add(c.parent)
                extended.append(parent)
        for i, seq in enumerate(beams):
            if i not in kept:
                self.scheduler.finish(seq)
        for seq, c in zip(extended, chosen, strict=True):
            seq.output_token_ids.append(c.token_id)
            seq.cumulative_logprob = c.cum_logprob
            seq.awaiting = False
        return extended

    def _sample_row(self, seq: Sequence) -> SampleRow:
        params = seq.params
        banned: tuple[int, ...] = ()
        if len(seq.output_token_ids) < params.min_tokens:
            banned = tuple(params.stop_token_ids) + (() if params.ignore_eos else tuple(self.eos_token_ids))
        generator = self.requests[seq.request_id].generator
        return SampleRow(
            params, generator, banned, seq.prompt_token_ids, seq.output_token_ids, guide=seq.guide
        )

    def _append_token(self, seq: Sequence, smp) -> None:
        seq.output_token_ids.append(smp.token_id)
        if smp.logprob is not None:
            seq.cumulative_logprob += smp.logprob
            seq.output_logprobs.append(smp.top_logprobs)
        new_text = detokenizer.decode_new_text(self.tokenizer, seq) if self.tokenizer is not None else ""
        params, token = seq.params, smp.token_id
        if seq.guide is not None and not seq.guide.accept(token):
            logger.error("guided decoding: %s sampled token %d its grammar forbids", seq.seq_id, token)
            seq.finish_reason = "abort"
        elif not params.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif (stop := detokenizer.find_stop_string(seq, new_text)) is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop
        elif seq.guide is not None and seq.guide.finished:  # the grammar ended (its end token came)
            seq.finish_reason = "stop"
        elif seq.max_new_tokens(self.max_model_len) == 0:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            self.scheduler.finish(seq)

    def _request_output(self, request: Request) -> RequestOutput:
        if request.beam_search is not None:
            outputs = [
                CompletionOutput(
                    index=i,
                    text=self._decode(h.token_ids, request.params.skip_special_tokens),
                    token_ids=h.token_ids,
                    cumulative_logprob=h.cum_logprob,
                    finish_reason=h.finish_reason,
                )
                for i, h in enumerate(request.beam_search.finished)
            ]
        else:
            outputs = [
                CompletionOutput(
                    index=seq.index,
                    text=seq.text,
                    token_ids=list(seq.output_token_ids),
                    cumulative_logprob=seq.cumulative_logprob
                    if request.params.logprobs is not None
                    else None,
                    logprobs=list(seq.output_logprobs) if request.params.logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
                for seq in request.seqs
            ]
        finished = request.finished
        if finished:
            del self.requests[request.request_id]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=request.first_seq.num_prefix_hits,
        )

    def _decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


class _PhaseClock:
    """Adds the wall time since the previous lap to a phase of the step."""

    def __init__(self):
        self.seconds = dict.fromkeys(STEP_PHASES, 0.0)
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now
