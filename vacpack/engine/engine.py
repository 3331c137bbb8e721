"""LLMEngine: requests in, outputs out, one step at a time.

    step() = schedule -> launch the model on the device -> update requests from a finished step

The scheduler owns every request's life (admission, pages, stop checks, finishing); the runner
turns a step into tensors and runs the model; the executor decides where the device work runs.
The engine wires them together and keeps at most one launched step whose results it has not
read: with async scheduling, step N+1 is launched before step N is read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from vacpack.config import EngineConfig
from vacpack.distributed.control import Program
from vacpack.engine.attention_choice import select_engine_attention
from vacpack.engine.device_setup import setup_engine_device
from vacpack.engine.model_runner import ModelRunner, PreparedStep
from vacpack.engine.request import build_request, check_priority, check_prompt
from vacpack.engine.request_outputs import make_output
from vacpack.engine.sampler import Sampler
from vacpack.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from vacpack.engine.speculation import SpeculationConfig
from vacpack.engine.state import EngineSetup, EngineState
from vacpack.engine.stats import EngineStats
from vacpack.engine.step_executor import StepHandle, create_executor
from vacpack.engine.timeline import StepTimeline, StepTiming
from vacpack.inputs import PromptType, encode_prompt
from vacpack.kvcache import PagePool
from vacpack.lora.manager import LoraManager
from vacpack.lora.request import LoRARequest
from vacpack.outputs import RequestOutput
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
# Steps in a row that run nothing, with nothing in flight, no grammar compiling and requests
# waiting, before the engine says it is stuck. One such step can be a grammar finishing
# between the schedule and the check; the second sees the same state as the first.
MAX_IDLE_STEPS = 2


class EngineStalledError(RuntimeError):
    """The engine holds requests it can never run (a bug: KV pages lost, say). Raised instead
    of looping forever; the server fails the requests and keeps serving."""


@dataclass(frozen=True)
class _LaunchedStep:
    """A step handed to the device whose results the host has not read yet."""

    step_index: int
    schedule: SchedulerOutput
    prepared: PreparedStep
    handle: StepHandle
    prepare_start_s: float
    launch_s: float
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
        device = loaded.device
        self.max_num_batched_tokens = config.max_num_batched_tokens or DEFAULT_BATCHED_TOKENS.get(
            device.type, 2048
        )
        model_config = loaded.config
        # Chosen before the other ranks set up: they then find rank 0's measured choice in
        # the on-disk cache instead of timing on their own.
        selected = select_engine_attention(config, loaded, self.max_num_batched_tokens)
        # With tensor parallelism every rank sets up its own shard's cache and graphs alongside.
        setup_program = (
            loaded.driver.program(Program.ENGINE_SETUP, [self.max_num_batched_tokens])
            if loaded.driver is not None
            else nullcontext()
        )
        with setup_program:
            engine_device = setup_engine_device(
                config, loaded, self.max_num_batched_tokens, selected.backend
            )
        self.attention = engine_device.attention
        self.kv_sizing, self.kv_cache = engine_device.kv_sizing, engine_device.kv_cache
        self.page_pool = PagePool(
            self.kv_sizing.num_pages, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs,
                self.max_num_batched_tokens,
                config.block_size,
                model_config.kv_window,
                _speculation(config),
                config.max_loras if config.enable_lora else None,
                config.scheduling_policy,
            ),
            self.page_pool,
        )
        self.sampler = Sampler(model_config.vocab_size, device, seed=config.seed)
        self.structured = StructuredOutputManager(
            loaded.tokenizer, model_config.vocab_size, loaded.eos_token_ids, device
        )
        # Speculative decoding reads each step's tokens before drafting the next: synchronous.
        self.async_scheduling = not config.num_speculative_tokens and _resolve_async_scheduling(
            config.async_scheduling, device
        )
        # LoRA: adapters on the linear layers, for the steps whose sequences run one.
        self.lora = (
            LoraManager.for_engine(config, loaded.model, device, loaded.dtype)
            if config.enable_lora
            else None
        )
        engine_device.forward.lora = self.lora
        self.runner = ModelRunner(
            engine_device.forward,
            self.sampler,
            loaded.driver,
            # Later steps' placeholders name tokens only rank 0 sampled: every rank needs them.
            shares_sampled_tokens=loaded.driver is not None and self.async_scheduling,
        )
        graph_runner = engine_device.graph_runner
        self.executor = create_executor(device, self.async_scheduling)
        self.stats = EngineStats()
        self.timeline = StepTimeline()
        self.setup = EngineSetup(
            device=str(device),
            dtype=loaded.dtype_description,
            attention_backend=self.attention.name,
            async_scheduling=self.async_scheduling,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            kv_cache_pages=self.kv_sizing.num_pages,
            page_size=config.block_size,
            kv_cache_keys="packed" if self.kv_cache.packed_keys else "token rows",
            kv_cache_bytes=self.kv_cache.num_bytes,
            kv_cache_source=self.kv_sizing.source,
            cuda_graph_batch_sizes=tuple(graph_runner.buckets) if graph_runner else (),
            cuda_graph_memory_bytes=engine_device.graph_memory_bytes,
            measured_choices=selected.choices + (self.lora.measured_choices if self.lora else ()),
        )
        self._in_flight: _LaunchedStep | None = None
        self._num_launched_steps = 0
        self._num_idle_steps = 0  # steps in a row that could not run anything (see _check_progress)
        logger.info(
            "vacpack engine: %s on %s in %s; KV cache %d pages x %d tokens (%s), keys: %s",
            model_config.architecture,
            device,
            loaded.dtype_description,
            self.kv_sizing.num_pages,
            config.block_size,
            self.kv_sizing.source,
            self.setup.kv_cache_keys,
        )

    # ----------------------------------------------------------------- requests in
    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raises ValueError for a prompt the engine cannot run; call before add_request."""
        check_prompt(prompt_token_ids, self.loaded.config.vocab_size, self.loaded.max_model_len)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        prompt_text: str | None = None,
        prompt_logprobs_start: int = 1,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> None:
        """Queues a request. The prompt is text (tokenized here), token ids, or a vLLM prompt
        dict; `prompt_text` is the text of prompt token ids for the outputs. With
        params.prompt_logprobs, logprobs are computed for prompt positions from
        `prompt_logprobs_start` on; positions before it may come from the prefix cache (scoring
        a continuation after a shared context computes the context once).
        params.truncate_prompt_tokens keeps the prompt's last tokens (ValueError where it is
        above max_model_len, as vLLM refuses it); `lora_request` names the LoRA adapter it
        runs (loaded on first use; the engine needs enable_lora). `priority` (lower first)
        orders requests under scheduling_policy="priority"; fcfs takes only 0, as vLLM."""
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        check_priority(priority, self.config.scheduling_policy)
        if not isinstance(params, SamplingParams):
            raise TypeError(
                f"params must be SamplingParams, got {type(params).__name__}: the engine "
                "generates (embed, classify and score are LLM's corpus jobs)"
            )
        prompt_text, prompt_token_ids = encode_prompt(prompt, self.loaded.tokenizer, prompt_text)
        prompt_token_ids = params.truncate_prompt(prompt_token_ids, self.loaded.max_model_len)
        self.validate_prompt(prompt_token_ids)
        grammar = self.structured.check(params)
        lora_id = self.add_adapter(lora_request)
        request = build_request(
            request_id,
            prompt_text,
            prompt_token_ids,
            params,
            tokenizer=self.loaded.tokenizer,
            stop_token_ids=params.all_stop_token_ids(self.loaded.eos_token_ids),
            max_total_tokens=self.loaded.max_model_len,
            device=self.loaded.device,
            prompt_logprobs_start=prompt_logprobs_start,
            lora_id=lora_id,
        )
        request.lora_request = lora_request
        request.priority = priority
        for sequence in request.sequences:
            sequence.constraints = self.structured.constraints_for(sequence.params, grammar)
        self.scheduler.add_request(request)

    def add_adapter(self, lora_request: LoRARequest | None) -> int:
        """The adapter's id, loaded if new (0 without one); ValueError for one that does not
        fit the model, or without enable_lora."""
        if lora_request is None:
            return 0
        if self.lora is None:
            raise ValueError(
                f"LoRA adapter {lora_request.lora_name!r} given, but the engine was started "
                "without enable_lora"
            )
        if self.lora.add(lora_request) and self.loaded.driver is not None:
            message = LoraManager.change_message(lora_request.lora_int_id, lora_request.lora_path)
            with self.loaded.driver.program(Program.LORA_ADAPTER, message):
                pass  # every rank loads its slices of it
        return lora_request.lora_int_id

    def remove_adapter(self, lora_id: int) -> None:
        """Unloads a LoRA adapter; ValueError while an unfinished request runs it."""
        if self.lora is None or lora_id not in self.lora.adapters:
            raise ValueError(f"no LoRA adapter with lora_int_id {lora_id} is loaded")
        num_using = sum(
            sequence.lora_id == lora_id
            for request in self.scheduler.requests.values()
            for sequence in request.sequences
            if not sequence.is_finished
        )
        if num_using:
            raise ValueError(
                f"LoRA adapter {lora_id} is in use by {num_using} unfinished sequences: unload "
                "it once they finish"
            )
        self.lora.remove(lora_id)
        if self.loaded.driver is not None:
            with self.loaded.driver.program(
                Program.LORA_ADAPTER, LoraManager.change_message(lora_id, None)
            ):
                pass

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stops a request (or each of several) and frees its KV pages; unknown or finished
        ids are ignored."""
        for one_id in [request_id] if isinstance(request_id, str) else request_id:
            self.scheduler.abort_request(one_id)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix, as vLLM's does: False, with nothing changed, while a
        request is unfinished (its pages may be cached and matched mid-flight)."""
        if self.has_unfinished_requests():
            return False
        self.page_pool.forget_prefixes()
        return True

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.loaded.tokenizer

    def get_num_unfinished_requests(self) -> int:
        return self.num_unfinished_requests

    def has_unfinished_requests(self) -> bool:
        """True while a request is unfinished or a launched step is still to be read."""
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests)

    # ----------------------------------------------------------------- one step
    def step(self) -> list[RequestOutput]:
        """Runs one batch; returns an output for each request that progressed. With async
        scheduling the outputs are those of the step launched by the previous call."""
        prepare_start_s = time.perf_counter()
        had_step_in_flight = self._in_flight is not None
        schedule = self.scheduler.schedule()
        must_read_first = schedule.reads_known_outputs(self.executor.work_may_wait_for_host)
        outputs = self._read_in_flight() if must_read_first else []
        launched = self._launch(schedule.without_finished(), prepare_start_s)
        outputs += self._read_previous(launched)
        self._in_flight = launched
        if not self.async_scheduling:
            outputs += self._read_in_flight()
        idle = launched is None and not had_step_in_flight and not schedule.preempted
        self._check_progress(idle)
        return outputs

    def _check_progress(self, idle: bool) -> None:
        """Raises EngineStalledError when nothing can ever run again: the step ran nothing,
        read nothing and preempted nothing, so the scheduler's state is what it was, and no
        grammar compiling can change it."""
        scheduler = self.scheduler
        if not idle or not scheduler.has_unfinished_requests() or scheduler.waits_for_grammar():
            self._num_idle_steps = 0
            return
        self._num_idle_steps += 1
        if self._num_idle_steps < MAX_IDLE_STEPS:
            return
        self._num_idle_steps = 0
        pool = self.page_pool
        raise EngineStalledError(
            f"the engine cannot run any of its {len(scheduler.requests)} unfinished requests "
            f"({len(scheduler.waiting)} sequences waiting, {len(scheduler.running)} running; "
            f"{pool.num_used_pages} of {pool.num_pages} KV pages held) though nothing runs or "
            "compiles. This is a bug in vacpack; please report it with the engine arguments"
        )

    def state(self) -> EngineState:
        cache = self.page_pool.stats
        return EngineState(
            num_unfinished_requests=len(self.scheduler.requests),
            num_running_sequences=len(self.scheduler.running),
            num_waiting_sequences=len(self.scheduler.waiting),
            kv_pages_used=self.page_pool.num_used_pages,
            kv_pages_total=self.page_pool.num_pages,
            num_prefix_queried_tokens=cache.num_queried_tokens,
            num_prefix_hit_tokens=cache.num_hit_tokens,
            num_prefix_evictions=cache.num_evictions,
            num_steps=self.stats.num_steps,
            num_processed_tokens=self.stats.num_processed_tokens,
            num_generated_tokens=self.stats.num_generated_tokens,
            num_preemptions=self.stats.num_preemptions,
            num_draft_tokens=self.scheduler.num_draft_tokens,
            num_accepted_draft_tokens=self.scheduler.num_accepted_draft_tokens,
        )

    def _launch(self, schedule: SchedulerOutput, prepare_start_s: float) -> _LaunchedStep | None:
        if not schedule.chunks:
            return None
        with self.executor.stream_context():
            prepared = self.runner.prepare(schedule.chunks)
            token_masks = self.structured.step_masks(prepared.sampled_sequences)
            launch_s = time.perf_counter()
            handle = self.executor.launch(lambda: self.runner.run(prepared, token_masks))
        self.scheduler.on_launch(schedule.chunks, prepared.sampled_sequences, prepared.placeholders)
        self._num_launched_steps += 1
        return _LaunchedStep(
            self._num_launched_steps - 1,
            schedule,
            prepared,
            handle,
            prepare_start_s,
            launch_s,
            token_masks,
        )

    def _read_previous(self, launched: _LaunchedStep | None) -> list[RequestOutput]:
        """Reads the step launched before `launched`, then fills `launched`'s token masks that
        needed its tokens (the device waits for them to sample, after the step's forward)."""
        if launched is None and self._in_flight is None:
            self.structured.wait_for_grammars(GRAMMAR_WAIT_S)  # nothing runs until one compiles
        try:
            return self._read_in_flight()
        finally:
            if launched is not None and launched.token_masks is not None:
                self.structured.fill(launched.token_masks, launched.prepared.sampled_sequences)

    def _read_in_flight(self) -> list[RequestOutput]:
        """Waits for the launched step's results (if any) and applies them to its requests."""
        launched, self._in_flight = self._in_flight, None
        if launched is None:
            return []
        device_output, device_timing = launched.handle.wait()
        process_start_s = time.perf_counter()
        result = self.runner.result(launched.prepared, device_output)
        update = self.scheduler.update_from_output(launched.schedule.chunks, result)
        outputs = [o for request in update.requests if (o := make_output(request)) is not None]
        process_end_s = time.perf_counter()
        masks = launched.token_masks
        self.stats.record_step(
            result.num_tokens, update.num_generated_tokens, len(launched.schedule.preempted)
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
                num_preempted=len(launched.schedule.preempted),
                kv_pages_used=self.page_pool.num_used_pages,
                kv_pages_total=self.page_pool.num_pages,
                collective_s=result.collective_s,
                mask_fill_start_s=masks.fill_start_s if masks else 0.0,
                mask_fill_end_s=masks.fill_end_s if masks else 0.0,
            )
        )
        return outputs


def _speculation(config: EngineConfig) -> SpeculationConfig | None:
    if not config.num_speculative_tokens:
        return None
    return SpeculationConfig(
        config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
    )


def _resolve_async_scheduling(setting: bool | None, device: torch.device) -> bool:
    """On by default where the device runs while the host works (CUDA). On a CPU the host and
    the "device" share the same cores, so it stays off unless asked for."""
    return device.type == "cuda" if setting is None else setting
