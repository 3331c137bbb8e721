"""Checks that depend on how a run was started, not on the request alone: the model name a
request may give, the most choices (n) one request may ask for, and the most sequences
(prompts x n) it may start.

The server and batch files share them, so both refuse the same requests with the same status
and message. This module imports nothing heavy: option parsing reads DEFAULT_MAX_N from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from vacpack.lora.request import LoRARequest
from vacpack.openai_api.errors import APIError, bad_request

NO_ADAPTERS: Mapping[str, LoRARequest] = MappingProxyType({})

# OpenAI's own bound on n. vLLM's bound (VLLM_MAX_N_SEQUENCES, 16,384) only guards memory; here
# a request's n sequences run together, so a much larger n would hold most of the engine's
# slots for one client (and every sequence costs memory while it is added).
DEFAULT_MAX_N = 128

# A request's sequences are added to the engine in one go, on the thread that runs every
# client's steps, and each holds memory from then on: without a bound, a 32 MiB body of short
# prompts with n=128 starts millions of sequences and stalls every other client for minutes.
# 4,096 is 32 prompts at OpenAI's largest n, or 4,096 prompts of one choice each.
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 4096


def check_model(
    model: str | None,
    served_model_name: str,
    adapters: Mapping[str, LoRARequest] = NO_ADAPTERS,
) -> LoRARequest | None:
    """The LoRA adapter the request names (None: the base model, also when it names none);
    404 model_not_found for any other name."""
    if model is None or model == served_model_name:
        return None
    adapter = adapters.get(model)
    if adapter is None:
        names = ", ".join(f"`{name}`" for name in [served_model_name, *adapters])
        raise APIError(
            404,
            f"The model `{model}` does not exist; the models served here are {names}."
            if adapters
            else f"The model `{model}` does not exist; the model served here is "
            f"`{served_model_name}`.",
            param="model",
            code="model_not_found",
        )
    return adapter


def check_pooling_model(
    model: str | None, served_model_name: str, adapters: Mapping[str, LoRARequest]
) -> None:
    """check_model, and a 400 for an adapter's name: adapters change generation only."""
    if check_model(model, served_model_name, adapters) is not None:
        raise bad_request(
            f"`{model}` is a LoRA adapter: adapters serve completions and chat only; name "
            f"`{served_model_name}` for embeddings, scores and classes",
            "model",
        )


def check_n(n: int | None, max_n: int) -> None:
    """400 when a request asks for more choices than the run allows (--max-n)."""
    if n is not None and n > max_n:
        raise bad_request(f"n must be at most {max_n} here (--max-n), got {n}", "n")


def check_num_sequences(num_prompts: int, n: int | None, max_sequences: int) -> None:
    """400 when a request's prompts x n exceed what the run allows (--max-sequences-per-request).
    Check before tokenizing: counting the prompts is cheap, tokenizing a million is not."""
    n = n or 1
    num_sequences = num_prompts * n
    if num_sequences > max_sequences:
        raise bad_request(
            f"this request starts {num_prompts} prompt(s) x n={n} = {num_sequences} sequences; "
            f"at most {max_sequences} here (--max-sequences-per-request): split it into smaller "
            "requests",
            "prompt" if num_prompts > 1 else "n",
        )
