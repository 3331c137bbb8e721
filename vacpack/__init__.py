"""vacpack: an LLM inference engine that keeps the accelerator full of useful work."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from vacpack.huge_pages import request_huge_pages

__version__ = "0.1.0"

# Before anything allocates: PyTorch decides once whether large host tensors get huge pages.
request_huge_pages()

# Imported on first use, so that `vacpack --help` and `import vacpack.testing` stay fast.
_EXPORTS = {
    "LLM": "vacpack.llm",
    "LLMEngine": "vacpack.llm",
    "LoRARequest": "vacpack.lora.request",
    "EngineArgs": "vacpack.config",
    "BeamSearchParams": "vacpack.beam_search",
    "EngineConfig": "vacpack.config",
    "SamplingParams": "vacpack.sampling",
    "PoolingParams": "vacpack.pooling_params",
    "PoolingRequestOutput": "vacpack.outputs",
    "StructuredOutputsParams": "vacpack.structured.params",
    "RequestOutput": "vacpack.outputs",
    "CompletionOutput": "vacpack.outputs",
    "Logprob": "vacpack.outputs",
    "TextPrompt": "vacpack.inputs",
    "TokensPrompt": "vacpack.inputs",
}

if TYPE_CHECKING:
    from vacpack.beam_search import BeamSearchParams
    from vacpack.config import EngineArgs, EngineConfig
    from vacpack.inputs import TextPrompt, TokensPrompt
    from vacpack.llm import LLM, LLMEngine
    from vacpack.lora.request import LoRARequest
    from vacpack.outputs import CompletionOutput, Logprob, PoolingRequestOutput, RequestOutput
    from vacpack.pooling_params import PoolingParams
    from vacpack.sampling import SamplingParams
    from vacpack.structured.params import StructuredOutputsParams


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'vacpack' has no attribute {name!r}")


__all__ = [
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "EngineArgs",
    "EngineConfig",
    "LLMEngine",
    "LoRARequest",
    "Logprob",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
]
