"""LLM: the offline Python API, named and shaped as vLLM's."""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from collections.abc import Mapping, Sequence
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any, cast

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from vacpack.chat_turns import template_turn
from vacpack.config import EngineArgs, EngineConfig
from vacpack.corpus_jobs import CorpusJobs
from vacpack.distributed.driver import Driver
from vacpack.engine import engine as step_engine
from vacpack.engine.request import check_priority
from vacpack.generation_defaults import sampling_defaults
from vacpack.inputs import PromptType, as_prompt_list, encode_prompt
from vacpack.lora.request import LoRARequest
from vacpack.outputs import RequestOutput, RequestOutputKind
from vacpack.runtime import LoadedModel, load
from vacpack.sampling import SamplingParams
from vacpack.tokenizer import apply_chat_template

if TYPE_CHECKING:
    from vacpack.beam_search import BeamSearchOutput, BeamSearchParams
    from vacpack.corpus.runner import CorpusRunner

Conversation = list[dict[str, Any]]


class LLM(CorpusJobs):
    """Generate from a Hugging Face checkpoint (local directory or hub id).

    Engine arguments are EngineConfig's fields, named as vLLM names them: max_model_len,
    max_num_seqs, max_num_batched_tokens, block_size, seed, tokenizer, ... Generation is
    here; the corpus jobs (embed, score, loglikelihood, classify, encode) are CorpusJobs'.

    With tensor_parallel_size N > 1 the model is split over N processes, this one being rank
    0; `close()` (or leaving a `with` block, or the LLM being garbage-collected, or the
    interpreter exiting) stops the others.
    """

    def __init__(
        self, model: str, dtype: str = "auto", device: str = "auto", **engine_args: Any
    ) -> None:
        self.config = EngineArgs(model, dtype=dtype, device=device, **engine_args)
        self.loaded, self._close_group = _load(self.config, self)
        self.sampling_defaults: Mapping[str, Any] = MappingProxyType(
            sampling_defaults(self.config.generation_config, self.loaded.model_dir)
        )
        try:
            self.get_default_sampling_params()
        except ValueError as error:
            raise ValueError(
                f"the model's recommended sampling ({self.config.generation_config}): {error}"
            ) from None
        self._engine: step_engine.LLMEngine | None = None
        self._corpus_runner: CorpusRunner | None = None
        self._request_counter = itertools.count()

    @property
    def engine(self) -> step_engine.LLMEngine:
        """The generation engine, built (with its KV cache) on first use."""
        if self._engine is None:
            self._engine = step_engine.LLMEngine(self.config, self.loaded)
        return self._engine

    @property
    def llm_engine(self) -> step_engine.LLMEngine:
        """vLLM's name for the engine (add_request, step, abort_request, ...)."""
        return self.engine

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.loaded.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix (a benchmark's runs then start cold); False while the
        engine has unfinished requests, as in vLLM."""
        return self.engine.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` sample with when given no SamplingParams: the model's
        recommended sampling (generation_config), else SamplingParams' defaults."""
        return SamplingParams(**self.sampling_defaults)

    def close(self) -> None:
        """Stops the tensor-parallel workers, if any (nothing to do for one process)."""
        if self._close_group is not None:
            self._close_group()

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt; outputs come back in input order. `lora_request`: the
        LoRA adapter every prompt runs, or one (or None) per prompt (needs enable_lora).
        `priority`: one per prompt, lower first (needs scheduling_policy="priority").

        Every prompt is checked before any work starts, so a bad one raises without running the
        others and leaves the engine ready for the next call.
        """
        batch = as_prompt_list(prompts)
        if not batch:
            return []
        params_list = _as_params_list(
            self.get_default_sampling_params() if sampling_params is None else sampling_params,
            len(batch),
        )
        max_model_len = self.loaded.max_model_len
        encoded = [
            (text, params.truncate_prompt(token_ids, max_model_len))
            for (text, token_ids), params in zip(map(self._encode, batch), params_list, strict=True)
        ]
        for index, ((_, token_ids), params) in enumerate(zip(encoded, params_list, strict=True)):
            try:
                self.engine.validate_prompt(token_ids)
                self.engine.structured.check(params)
            except ValueError as error:
                raise ValueError(f"prompt {index}: {error}") from None
        priorities = [0] * len(batch) if priority is None else list(priority)
        if len(priorities) != len(batch):
            raise ValueError(f"got {len(priorities)} priorities for {len(batch)} prompts")
        for value in priorities:
            check_priority(value, self.config.scheduling_policy)
        adapters = self._add_adapters(lora_request, len(batch))
        return self._run(encoded, params_list, use_tqdm, adapters, priorities)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """The best `params.beam_width` hypotheses of each prompt (vLLM's `beam_search`, with
        its scoring: beam_search.py), in input order; `lora_request` as in `generate`."""
        from vacpack.beam_search import run_beam_search

        batch = as_prompt_list(prompts)
        encoded = [token_ids for _, token_ids in map(self._encode, batch)]
        for index, token_ids in enumerate(encoded):
            try:
                self.engine.validate_prompt(token_ids)
            except ValueError as error:
                raise ValueError(f"prompt {index}: {error}") from None
        adapters = self._add_adapters(lora_request, len(encoded))
        return run_beam_search(self.engine, encoded, params, use_tqdm, adapters) if encoded else []

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        continue_final_message: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates replies to conversations rendered by the tokenizer's chat template, which
        also gets `tools` (OpenAI function tools) when given, and `chat_template_kwargs` (such as
        Qwen 3's enable_thinking). Messages are read as the server reads them (chat_turns.py):
        text parts joined, earlier calls' arguments decoded. `continue_final_message` leaves the
        last (assistant) message open for the model to continue, instead of a new turn."""
        conversations: list[Conversation]
        if messages and isinstance(messages[0], Mapping):
            conversations = [cast(Conversation, messages)]
        else:
            conversations = list(cast(Sequence[Conversation], messages))
        template_kwargs = dict(chat_template_kwargs or {})
        if tools:
            template_kwargs["tools"] = tools
        if continue_final_message:
            if add_generation_prompt:
                raise ValueError(
                    "continue_final_message continues the last message: pass "
                    "add_generation_prompt=False with it"
                )
            template_kwargs["continue_final_message"] = True
        prompts = [
            {
                "prompt_token_ids": apply_chat_template(
                    self.loaded.tokenizer,
                    [template_turn(message, index) for index, message in enumerate(conversation)],
                    add_generation_prompt=add_generation_prompt,
                    chat_template=chat_template,
                    **template_kwargs,
                )
            }
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _add_adapters(
        self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
    ) -> list[LoRARequest | None]:
        """Each prompt's adapter, every one loaded (and checked) before any work starts."""
        adapters = _as_adapter_list(lora_request, num_prompts)
        for adapter in {a.lora_int_id: a for a in adapters if a is not None}.values():
            self.engine.add_adapter(adapter)
        return adapters

    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return encode_prompt(prompt, self.loaded.tokenizer)

    def _run(
        self,
        encoded: list[tuple[str | None, list[int]]],
        params_list: list[SamplingParams],
        use_tqdm: bool,
        adapters: list[LoRARequest | None],
        priorities: list[int],
    ) -> list[RequestOutput]:
        engine = self.engine
        order = {str(next(self._request_counter)): index for index in range(len(encoded))}
        results: list[RequestOutput | None] = [None] * len(encoded)
        progress = tqdm(total=len(encoded), desc="generate", unit="req", disable=not use_tqdm)
        num_output_tokens = 0
        try:
            for request_id, index in order.items():
                text, token_ids = encoded[index]
                # One output per request, when it finishes: nothing is built per step.
                params = dataclasses.replace(
                    params_list[index], output_kind=RequestOutputKind.FINAL_ONLY
                )
                engine.add_request(
                    request_id,
                    token_ids,
                    params,
                    prompt_text=text,
                    lora_request=adapters[index],
                    priority=priorities[index],
                )
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        results[order[output.request_id]] = output
                        num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
                        progress.update(1)
                        elapsed = progress.format_dict["elapsed"] or 1e-9
                        progress.set_postfix_str(f"{num_output_tokens / elapsed:.1f} out tok/s")
        finally:
            progress.close()
            for request_id in order:  # after an interruption, leave nothing running
                engine.abort_request(request_id)
        return [r for r in results if r is not None]


class LLMEngine(step_engine.LLMEngine):
    """vLLM's LLMEngine, built from engine arguments: the step engine with its model loaded
    (split over tensor_parallel_size processes too, stopped by `close()` or when the engine is
    collected).

        engine = LLMEngine.from_engine_args(EngineArgs(model=...))
        engine.add_request("0", "Hello", SamplingParams(max_tokens=16))
        while engine.has_unfinished_requests():
            for output in engine.step(): ...
    """

    def __init__(self, config: EngineConfig) -> None:
        loaded, self._close_group = _load(config, self)
        super().__init__(config, loaded)

    @classmethod
    def from_engine_args(cls, engine_args: EngineConfig) -> LLMEngine:
        return cls(engine_args)

    def close(self) -> None:
        """Stops the tensor-parallel workers, if any."""
        if self._close_group is not None:
            self._close_group()


def _load(config: EngineConfig, owner: object) -> tuple[LoadedModel, weakref.finalize | None]:
    """The model for `owner`; split over tensor_parallel_size processes, with the finalizer
    that stops them (run by close(), or when owner is collected, or at exit)."""
    if config.tensor_parallel_size == 1:
        return load(config), None
    # Imported here: a single-process model never loads the worker machinery.
    from vacpack.tensor_parallel import load_tensor_parallel

    num_threads = torch.get_num_threads()  # rank 0 takes its share; given back on close
    loaded = load_tensor_parallel(config)
    assert loaded.driver is not None
    return loaded, weakref.finalize(owner, _close_group, loaded.driver, num_threads)


def _close_group(driver: Driver, num_threads: int) -> None:
    driver.close()
    torch.set_num_threads(num_threads)


def _as_adapter_list(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    adapters = list(lora_request)
    if len(adapters) != num_prompts:
        raise ValueError(
            f"got {len(adapters)} lora_requests for {num_prompts} prompts: give one, or one "
            "per prompt"
        )
    return adapters


def _as_params_list(
    sampling_params: SamplingParams | Sequence[SamplingParams], num_prompts: int
) -> list[SamplingParams]:
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    params_list = list(sampling_params)
    if len(params_list) != num_prompts:
        raise ValueError(
            f"got {len(params_list)} SamplingParams for {num_prompts} prompts; give one or one each"
        )
    return params_list
