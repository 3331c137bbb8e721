"""LLM: the offline Python API, named and shaped as vLLM's."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from vacpack.config import EngineConfig
from vacpack.engine.engine import LLMEngine
from vacpack.outputs import RequestOutput, RequestOutputKind
from vacpack.sampling import SamplingParams
from vacpack.tokenizer import apply_chat_template

# A prompt is text, token ids, or a dict with "prompt" or "prompt_token_ids".
PromptType = str | Sequence[int] | Mapping[str, Any]
Conversation = list[dict[str, Any]]

_ENGINE_ARGS = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}


class LLM:
    """Generate from a Hugging Face checkpoint (local directory or hub id).

    Engine arguments are EngineConfig's fields, named as vLLM names them: max_model_len,
    max_num_seqs, max_num_batched_tokens, block_size, seed, tokenizer, ...
    """

    def __init__(
        self, model: str, dtype: str = "auto", device: str = "auto", **engine_args: Any
    ) -> None:
        unknown = set(engine_args) - _ENGINE_ARGS
        if unknown:
            raise TypeError(
                f"unknown engine arguments {sorted(unknown)}; known: {sorted(_ENGINE_ARGS)}"
            )
        self.engine = LLMEngine(
            EngineConfig(model=model, dtype=dtype, device=device, **engine_args)
        )
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generates for every prompt; outputs come back in input order.

        Every prompt is checked before any work starts, so a bad one raises without running the
        others and leaves the engine ready for the next call.
        """
        batch = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(batch))
        encoded = [self._encode(prompt) for prompt in batch]
        for index, (_, token_ids) in enumerate(encoded):
            try:
                self.engine.validate_prompt(token_ids)
            except ValueError as error:
                raise ValueError(f"prompt {index}: {error}") from None
        return self._run(encoded, params_list, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generates replies to conversations rendered by the tokenizer's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        prompts = [
            {
                "prompt_token_ids": apply_chat_template(
                    self.engine.tokenizer,
                    list(conversation),
                    add_generation_prompt=add_generation_prompt,
                    chat_template=chat_template,
                )
            }
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.engine.tokenizer.encode(prompt)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._encode(prompt["prompt"])
            raise ValueError("a prompt dict needs a 'prompt' or a 'prompt_token_ids' key")
        return None, list(prompt)

    def _run(
        self,
        encoded: list[tuple[str | None, list[int]]],
        params_list: list[SamplingParams],
        use_tqdm: bool,
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
                engine.add_request(request_id, token_ids, params, prompt=text)
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


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts given")
    if isinstance(prompts[0], int):  # a single prompt given as token ids
        return [prompts]
    return prompts


def _as_params_list(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    params_list = list(sampling_params)
    if len(params_list) != num_prompts:
        raise ValueError(
            f"got {len(params_list)} SamplingParams for {num_prompts} prompts; give one or one each"
        )
    return params_list
