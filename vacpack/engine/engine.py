"""LLMEngine: requests in, outputs out, one step at a time.

    step() = schedule -> run the model once -> update requests and report

A user request with n samples is n engine sequences ("<id>/<i>") whose outputs are gathered
back into one RequestOutput.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from vacpack.attention import select_backend
from vacpack.attention.backend import BatchLayout
from vacpack.config import EngineConfig
from vacpack.detokenizer import RequestDetokenizer
from vacpack.engine.cuda_graphs import DecodeGraphRunner
from vacpack.engine.model_runner import ModelRunner, PreparedStep, StepResult
from vacpack.engine.request import Request
from vacpack.engine.request_outputs import UserRequest, make_output
from vacpack.engine.sampler import Sampler, make_request_generator
from vacpack.engine.scheduler import ScheduledRequest, Scheduler, SchedulerConfig
from vacpack.engine.stats import EngineStats
from vacpack.engine.step_executor import StepHandle, create_executor
from vacpack.engine.timeline import StepTimeline, StepTiming
from vacpack.kvcache import PagedKVCache, PagePool, kv_bytes_per_token
from vacpack.kvcache.sizing import size_kv_cache
from vacpack.models.forward_context import ForwardContext
from vacpack.outputs import (
    Logprob,
    RequestMetrics,
    RequestOutput,
)
from vacpack.runtime import LoadedModel, load
from vacpack.sampling import SamplingParams
from vacpack.structured.manager import StructuredOutputManager
from vacpack.structured.token_masks import StepTokenMasks

logger = logging.getLogger(__name__)

# A step's token budget when none is given: large enough that prefill matmuls run near the
# device's peak, small enough that decodes sharing the step are not held up for long.
DEFAULT_BATCHED_TOKENS = {"cpu": 2048, "cuda": 8192}
# With nothing to run until a grammar is compiled, a step waits this long for one at most.
GRAMMAR_WAIT_S = 0.05


@dataclass(frozen=True)
class _LaunchedStep:
    """A step handed to the device whose results the host has not read yet."""

    step_index: int
    prepared: PreparedStep
    handle: StepHandle
    token_indices: list[int]  # where each sampled token goes in its request's token_ids
    reaches_end: list[bool]  # per scheduled request: this step computes its last known token
    prepare_start_s: float
    launch_s: float
    num_preempted: int
    token_masks: StepTokenMasks | None  # constrained rows' masks; maybe filled after launch


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        loaded = loaded or load(config)
        if not loaded.is_decoder:
            raise ValueError(
                f"model {config.model!r} ({loaded.config.architecture}) is not a decoder: "
                "it cannot generate; use embed or classify"
            )
        self.config = config
        self.loaded = loaded
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.model_dir = loaded.model_dir
        self.model_config = loaded.config
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        self.max_model_len = loaded.max_model_len
        self.max_num_batched_tokens = config.max_num_batched_tokens or DEFAULT_BATCHED_TOKENS.get(
            self.device.type, 2048
        )
        self.attention = select_backend(
            config.attention_backend, self.device, self.dtype, self.model_config.head_dim
        )

        mc = self.model_config
        sizing = size_kv_cache(
            device=self.device,
            bytes_per_token=kv_bytes_per_token(
                mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype
            ),
            page_size=config.block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=config.max_num_seqs,
            explicit_budget_bytes=config.kv_cache_memory_bytes,
            gpu_memory_utilization=config.gpu_memory_utilization,
            cpu_kv_cache_fraction=config.cpu_kv_cache_fraction,
            profile_forward=self._profile_forward,
        )
        self.kv_cache = PagedKVCache(
            mc.num_layers,
            sizing.num_pages,
            config.block_size,
            mc.num_kv_heads,
            mc.head_dim,
            self.dtype,
            self.device,
        )
        self.kv_sizing = sizing
        self.graph_memory_bytes = 0
        self.page_pool = PagePool(sizing.num_pages, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, self.max_num_batched_tokens, config.block_size),
            self.page_pool,
        )
        self.sampler = Sampler(mc.vocab_size, self.device, seed=config.seed)
        self.structured = StructuredOutputManager(
            self.tokenizer, mc.vocab_size, self.eos_token_ids, self.device
        )
        self.runner = ModelRunner(
            self.model,
            self.kv_cache,
            self.attention,
            self.sampler,
            self.device,
            config.max_num_seqs,
            self._graph_runner(),
        )
        self.async_scheduling = _resolve_async_scheduling(config.async_scheduling, self.device)
        self.executor = create_executor(self.device, self.async_scheduling)
        self.stats = EngineStats()
        self.timeline = StepTimeline()
        self._in_flight: _LaunchedStep | None = None
        self._num_launched_steps = 0
        self._user_requests: dict[str, UserRequest] = {}
        logger.info(
            "vacpack engine: %s on %s in %s; KV cache %d pages x %d tokens (%s)",
            mc.architecture,
            self.device,
            self.dtype,
            sizing.num_pages,
            config.block_size,
            sizing.source,
        )

    # ----------------------------------------------------------------- requests in
    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raises ValueError for a prompt the engine cannot run; call before add_request."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab_size = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
        if bad:
            raise ValueError(
                f"prompt token ids must be integers in [0, {vocab_size}); got {bad[:5]}"
            )
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens, but the context is "
                f"max_model_len={self.max_model_len} tokens: at most {self.max_model_len - 1} "
                "prompt tokens leave room for one output token"
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        prompt_logprobs_start: int = 1,
    ) -> None:
        """Queues a request. With params.prompt_logprobs, logprobs are computed for prompt
        positions from `prompt_logprobs_start` on; positions before it may come from the prefix
        cache (scoring a continuation after a shared context computes the context once)."""
        if request_id in self._user_requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate_prompt(prompt_token_ids)
        grammar = self.structured.check(params)
        stop_ids = frozenset(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        metrics = RequestMetrics(arrival_time=time.perf_counter())
        sequences = []
        for index in range(params.n):
            # Each of the n samples gets its own seed, so that they differ, reproducibly.
            sample_params = params.child_params(index)
            generator = None
            if sample_params.seed is not None:
                generator = make_request_generator(sample_params.seed, self.device)
            sequences.append(
                Request(
                    request_id=f"{request_id}/{index}",
                    prompt_token_ids=list(prompt_token_ids),
                    params=sample_params,
                    stop_token_ids=stop_ids,
                    max_total_tokens=self.max_model_len,
                    generator=generator,
                    detokenizer=self._detokenizer_for(params),
                    metrics=RequestMetrics(arrival_time=metrics.arrival_time),
                    prompt_logprobs_start=prompt_logprobs_start,
                    constraints=self.structured.constraints_for(sample_params, grammar),
                )
            )
        self._user_requests[request_id] = UserRequest(request_id, prompt, sequences, metrics)
        for sequence in sequences:
            self.scheduler.add(sequence)

    def _detokenizer_for(self, params: SamplingParams) -> RequestDetokenizer:
        return RequestDetokenizer(
            self.tokenizer,
            stop_strings=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )

    def abort_request(self, request_id: str) -> None:
        user_request = self._user_requests.pop(request_id, None)
        if user_request is None:
            return
        for sequence in user_request.sequences:
            if not sequence.is_finished:
                sequence.drop_pending_tokens()
                self.scheduler.finish(sequence)

    def has_unfinished_requests(self) -> bool:
        """True while a request is unfinished or a launched step is still to be read."""
        return bool(self._user_requests) or self._in_flight is not None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._user_requests)

    # ----------------------------------------------------------------- one step
    def step(self) -> list[RequestOutput]:
        """Runs one batch; returns an output for each user request that progressed.

        Synchronous: schedule -> prepare -> launch -> wait -> read results. With async
        scheduling the results read in a call are those of the step launched by the previous
        call, so the host reads step N (stop checks, detokenizing, outputs) and prepares step
        N+1 while the device computes: step N+1 is launched before step N is read.
        """
        prepare_start_s = time.perf_counter()
        outputs: list[RequestOutput] = []
        schedule = self.scheduler.schedule()
        scheduled = schedule.scheduled
        if (
            scheduled
            and self._in_flight is not None
            and _needs_known_outputs(scheduled, self.executor.work_may_wait_for_host)
        ):
            # Penalties count the output tokens on the host: read the running step first.
            outputs += self._read(self._in_flight)
            self._in_flight = None
            scheduled = [item for item in scheduled if not item.request.is_finished]
        launched = None
        if scheduled:
            launched = self._launch(scheduled, prepare_start_s, len(schedule.preempted))
        elif self._in_flight is None:
            self.structured.wait_for_grammars(GRAMMAR_WAIT_S)
        try:
            if self._in_flight is not None:
                outputs += self._read(self._in_flight)
        finally:
            if launched is not None and launched.token_masks is not None:
                # The masks that needed the tokens just read; the device waits for them to
                # sample, after the step's forward.
                self.structured.fill(launched.token_masks, launched.prepared.sampled_requests)
        self._in_flight = launched
        if launched is not None and not self.async_scheduling:
            outputs += self._read(launched)
            self._in_flight = None
        return outputs

    def _launch(
        self, scheduled: list[ScheduledRequest], prepare_start_s: float, num_preempted: int
    ) -> _LaunchedStep:
        for item in scheduled:
            if item.request.metrics.first_scheduled_time is None:
                item.request.metrics.first_scheduled_time = prepare_start_s
        with self.executor.stream_context():
            prepared = self.runner.prepare(scheduled)
            token_masks = self.structured.step_masks(prepared.sampled_requests)
            launch_s = time.perf_counter()
            handle = self.executor.launch(lambda: self.runner.run(prepared, token_masks))
        reaches_end = [item.samples for item in scheduled]
        # Lengths advance at launch: the next step is scheduled as if this one had finished.
        for item in scheduled:
            item.request.num_computed_tokens += item.num_new_tokens
        token_indices = [
            request.add_pending_token(prepared.placeholder(row))
            for row, request in enumerate(prepared.sampled_requests)
        ]
        step_index = self._num_launched_steps
        self._num_launched_steps += 1
        return _LaunchedStep(
            step_index,
            prepared,
            handle,
            token_indices,
            reaches_end,
            prepare_start_s,
            launch_s,
            num_preempted,
            token_masks,
        )

    def _read(self, launched: _LaunchedStep) -> list[RequestOutput]:
        """Waits for a launched step's results and applies them to its requests."""
        device_output, device_timing = launched.handle.wait()
        process_start_s = time.perf_counter()
        prepared = launched.prepared
        result = self.runner.result(prepared, device_output)
        touched = self._apply_step(launched, result)
        outputs = []
        for user_request in touched:
            if user_request.num_unfinished == 0:
                del self._user_requests[user_request.request_id]
            output = make_output(user_request)
            if output is not None:
                outputs.append(output)
        process_end_s = time.perf_counter()
        masks = launched.token_masks
        self.stats.record_step(
            start_s=launched.prepare_start_s,
            end_s=process_end_s,
            num_tokens=result.num_tokens,
            num_decode_tokens=result.num_decode_tokens,
            num_preempted=launched.num_preempted,
            kv_pages_used=self.page_pool.num_used_pages,
        )
        self.timeline.record(
            StepTiming(
                step_index=launched.step_index,
                prepare_start_s=launched.prepare_start_s,
                launch_s=launched.launch_s,
                device_start_s=device_timing.device_start_s,
                device_end_s=device_timing.device_end_s,
                process_start_s=process_start_s,
                process_end_s=process_end_s,
                num_prefill_tokens=result.num_tokens - result.num_decode_tokens,
                num_decode_tokens=result.num_decode_tokens,
                num_padded_slots=result.num_padded_slots,
                kv_pages_used=self.page_pool.num_used_pages,
                kv_pages_total=self.page_pool.num_pages,
                mask_fill_start_s=masks.fill_start_s if masks else 0.0,
                mask_fill_end_s=masks.fill_end_s if masks else 0.0,
            )
        )
        return outputs

    def _apply_step(self, launched: _LaunchedStep, result: StepResult) -> list[UserRequest]:
        now = time.perf_counter()
        scheduled = launched.prepared.scheduled
        # Requests finished (stopped, aborted) after this step was launched: their rows are
        # computed but mean nothing now.
        finished_before = {id(item.request) for item in scheduled if item.request.is_finished}
        touched: dict[str, UserRequest] = {}
        for prompt_result in result.prompt_logprobs:
            request = prompt_result.request
            if id(request) in finished_before:
                continue
            lp = prompt_result.logprobs
            num_topk = request.params.prompt_logprobs
            for i in range(lp.token_logprobs.shape[0]):
                token_id = request.prompt_token_ids[prompt_result.first_position + 1 + i]
                request.prompt_logprobs.append(
                    self._position_logprobs(
                        token_id,
                        float(lp.token_logprobs[i]),
                        int(lp.token_ranks[i]),
                        lp.topk_token_ids[i, :num_topk].tolist(),
                        lp.topk_logprobs[i, :num_topk].tolist(),
                    )
                )
        sampled = list(
            zip(
                result.sampled_requests,
                result.sampled_token_ids,
                launched.token_indices,
                strict=True,
            )
        )
        for request, token_id, token_index in sampled:
            if not request.is_finished:
                request.resolve_pending_token(token_index, token_id)
        # Index the pages filled so far before stop checks free a finishing request's pages.
        for item in scheduled:
            if id(item.request) not in finished_before:
                self.scheduler.register_computed_pages(item.request)
        for row, (request, token_id, _) in enumerate(sampled):
            if request.is_finished:
                continue
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            self.stats.num_generated_tokens += 1
            if request.logprobs is not None:
                self._record_logprobs(request, token_id, row, result)
            grammar = self.structured.accept(request, token_id)
            self._check_stop(request, token_id, output_complete=grammar == "complete")
            if grammar == "refused" and not request.is_finished:
                self._finish(request, "abort", None)
        for item, reaches_end in zip(scheduled, launched.reaches_end, strict=True):
            request = item.request
            if id(request) in finished_before:
                continue
            user_request = self._user_requests[request.request_id.rpartition("/")[0]]
            if request.params.max_tokens == 0 and reaches_end:
                self._finish(request, "length", None)
            if request.is_finished:
                user_request.num_unfinished -= 1
                request.metrics.finished_time = now
            touched[user_request.request_id] = user_request
        return list(touched.values())

    def _check_stop(self, request: Request, token_id: int, output_complete: bool = False) -> None:
        """output_complete: the request's grammar allows no more tokens."""
        params = request.params
        # The sampler suppressed stop tokens until min_tokens, so any stop token here counts.
        stops_on_token = token_id in request.stop_token_ids
        if stops_on_token and not params.include_stop_str_in_output:
            stop_string = None  # as in vLLM, the stop token's own text is left out
        else:
            stop_string = request.detokenizer.update(
                [token_id], check_stop_strings=request.num_output_tokens > params.min_tokens
            )
        if stops_on_token:
            # EOS ends the request with stop_reason None, as in vLLM; a stop_token_id names itself.
            self._finish(request, "stop", token_id if token_id in params.stop_token_ids else None)
        elif stop_string is not None:
            self._finish(request, "stop", stop_string)
        elif output_complete:
            self._finish(request, "stop", None)
        elif request.num_output_tokens >= (params.max_tokens or request.max_total_tokens) or (
            request.num_known_tokens >= request.max_total_tokens
        ):
            self._finish(request, "length", None)

    def _finish(self, request: Request, reason: str, stop_reason: int | str | None) -> None:
        request.finish_reason = reason
        request.stop_reason = stop_reason
        request.detokenizer.finish()
        # Its pages may still be written by a launched step; a later step that reuses them
        # runs after it on the device (see step_executor).
        request.drop_pending_tokens()
        self.scheduler.finish(request)

    def _record_logprobs(
        self, request: Request, token_id: int, row: int, result: StepResult
    ) -> None:
        out = result.sampler_output
        num_topk = request.params.logprobs
        logprob = float(out.sampled_logprobs[row])
        request.cumulative_logprob += logprob
        request.logprobs.append(
            self._position_logprobs(
                token_id,
                logprob,
                int(out.sampled_ranks[row]),
                out.topk_token_ids[row, :num_topk].tolist(),
                out.topk_logprobs[row, :num_topk].tolist(),
            )
        )

    def _position_logprobs(
        self,
        token_id: int,
        logprob: float,
        rank: int,
        topk_ids: list[int],
        topk_logprobs: list[float],
    ) -> dict[int, Logprob]:
        decode = self.tokenizer.decode
        candidates = {token_id: Logprob(logprob, rank, decode([token_id]))}
        for rank_index, (tid, lp) in enumerate(zip(topk_ids, topk_logprobs, strict=True)):
            candidates.setdefault(tid, Logprob(lp, rank_index + 1, decode([tid])))
        return candidates

    # ----------------------------------------------------------------- set-up
    def _graph_runner(self) -> DecodeGraphRunner | None:
        """CUDA graphs of decode steps, captured now, after the KV cache exists (the graphs
        hold its addresses); None off CUDA, when disabled, or when the backend cannot."""
        if self.device.type != "cuda" or not self.config.enable_cuda_graphs:
            return None
        free_before_bytes, _ = torch.cuda.mem_get_info(self.device)
        graph_runner = DecodeGraphRunner(
            self.model,
            self.kv_cache,
            self.attention,
            self.config.max_num_seqs,
            -(-self.max_model_len // self.config.block_size),
            self.device,
            capture=True,
        )
        if not graph_runner.enabled:
            logger.info("attention backend %s cannot replay graphs: eager decode", self.attention)
            return None
        # The graphs' pool holds one decode batch's activations, a small share of the profile
        # forward's peak that sized the KV cache; measured here so the report shows it.
        free_after_bytes, _ = torch.cuda.mem_get_info(self.device)
        self.graph_memory_bytes = free_before_bytes - free_after_bytes
        logger.info(
            "captured CUDA graphs for decode batch sizes %s (%.0f MiB measured)",
            graph_runner.buckets,
            self.graph_memory_bytes / 2**20,
        )
        return graph_runner

    def _profile_forward(self) -> None:
        """One forward at the largest step shape, with no KV cache, to measure peak memory."""
        num_tokens = min(self.max_num_batched_tokens, self.max_model_len)
        layout = BatchLayout([num_tokens], [num_tokens])
        ctx = ForwardContext(
            self.attention, self.attention.build_metadata(layout, self.device), None
        )
        with torch.inference_mode():
            token_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
            hidden = self.model(token_ids, torch.arange(num_tokens, device=self.device), ctx)
            self.model.compute_logits(hidden[-min(num_tokens, self.config.max_num_seqs) :])


def _resolve_async_scheduling(setting: bool | None, device: torch.device) -> bool:
    """On by default where the device runs while the host works (CUDA). On a CPU the host and
    the "device" share the same cores, so it stays off unless asked for."""
    return device.type == "cuda" if setting is None else setting


def _needs_known_outputs(scheduled: list[ScheduledRequest], masks_may_wait: bool) -> bool:
    """True when a scheduled request's sampling reads its earlier output tokens on the host
    and one of them is still being sampled: penalties count them; a grammar's (or a multi-token
    bad word's) mask depends on them, unless the device work may wait for the host to fill
    the masks after launch (masks_may_wait)."""
    return any(
        item.request.num_pending_tokens
        and (
            item.request.params.repetition_penalty != 1.0
            or item.request.params.frequency_penalty != 0.0
            or item.request.params.presence_penalty != 0.0
            or (
                not masks_may_wait
                and item.request.constraints is not None
                and item.request.constraints.needs_known_outputs
            )
        )
        for item in scheduled
    )
