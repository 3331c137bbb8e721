"""EngineConfig: every engine knob in one validated, frozen place (names follow vLLM's).

Each field's docstring is its help text: `vacpack --help` flags are generated from these fields
(vacpack/cli/engine_args.py), so a new knob is on the command line as soon as it is here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class EngineConfig:
    model: str
    """A local checkpoint directory or a Hugging Face hub id."""
    tokenizer: str | None = None
    """The tokenizer's directory or hub id (default: the model's own)."""
    revision: str | None = None
    """The hub revision (branch, tag or commit) of the model and its tokenizer."""
    trust_remote_code: bool = False
    """Let transformers run code shipped with the checkpoint (its config and tokenizer)."""
    dtype: str = "auto"
    """auto (bfloat16; float16 for a float16 checkpoint on CUDA; on a CPU float32 where
    bfloat16 matmuls are measured much slower, a bfloat16 checkpoint's matrices then kept in
    bfloat16 where that is measured as fast), bfloat16, float16, or float32."""
    cpu_bf16_arithmetic: str = "auto"
    """CPU, bfloat16: the arithmetic of the products on the bfloat16 weights. auto (float32
    where it is measured much faster, as on CPUs without AVX512-BF16 or AMX; else bfloat16),
    bfloat16, or float32 (the activations, norms and KV cache float32 too; the linear weights
    and vocabulary tables stay bfloat16)."""
    device: str = "auto"
    """auto (cuda when present), cpu, cuda, or cuda:N."""
    max_model_len: int | None = None
    """Longest sequence, prompt and output together (default: the model's
    max_position_embeddings)."""
    max_num_seqs: int = 256
    """Most sequences running at once."""
    max_num_batched_tokens: int | None = None
    """Token budget of one step (default: 2048 on a CPU, 8192 on CUDA); corpus jobs measure
    their bin budget when it is not given."""
    block_size: int = 16
    """Tokens per KV page (vLLM's name; `page_size` below the configuration)."""
    enable_prefix_caching: bool = True
    """Reuse the KV pages of repeated prefixes."""
    seed: int = 0
    """Seed of the engine's random generator (requests may carry their own)."""
    generation_config: str = "auto"
    """Defaults for the sampling fields a request leaves out (temperature, top_p, top_k, min_p,
    repetition_penalty, max_tokens): auto (the model's generation_config.json), vllm (none:
    the library's own defaults), or a folder holding a generation_config.json."""
    kv_cache_dtype: str = "auto"
    """The KV cache's dtype: auto (the weights': a bfloat16 checkpoint computed in float32 on a
    CPU keeps its cache bfloat16 too), bfloat16, float16 or float32: the model's dtype, or on a
    CPU bfloat16 under float32 arithmetic (half the cache's memory; each value is rounded to
    bfloat16 as it is stored and widened as attention reads it)."""
    kv_cache_memory_bytes: int | None = None
    """An explicit KV cache budget in bytes (per tensor-parallel rank); by default it is
    measured."""
    gpu_memory_utilization: float = 0.9
    """CUDA: the share of the device's memory the engine may use, KV cache included."""
    cpu_kv_cache_fraction: float = 0.4
    """CPU: the share of the RAM available after loading the model that the KV cache takes."""
    attention_backend: str = "auto"
    """auto (the fastest backend available for the device, dtype and head size), or a
    backend's name: torch_sdpa, cpu_kernels, triton."""
    scheduling_policy: str = "fcfs"
    """fcfs (first come, first served), or priority: requests with a lower `priority` are
    admitted first and preempted last, arrival order breaking ties (vLLM's)."""
    async_scheduling: bool | None = None
    """Prepare step N+1 while the device runs step N (default: on for CUDA, off on a CPU);
    outputs are identical either way."""
    enable_cuda_graphs: bool = True
    """CUDA: replay decode steps from captured CUDA graphs."""
    num_threads: int | None = None
    """CPU: torch's intra-op threads (default: all cores; with tensor parallelism, each rank's
    share of them)."""
    tensor_parallel_size: int = 1
    """Split the model over this many processes (rank r on GPU r on CUDA; on a CPU, each rank
    on its share of the cores), each holding 1/N of the weights and KV heads."""
    num_speculative_tokens: int = 0
    """Speculative decoding by n-gram prompt lookup (vLLM's speculative_config method
    "ngram"): up to this many draft tokens per decode step, verified in one forward; 0 turns it
    off. Greedy and unseeded sampled sequences without penalties or token constraints
    speculate: greedy outputs are the same as without it, sampled ones follow the same
    distributions. Scheduling is then synchronous."""
    prompt_lookup_max: int = 4
    """Speculative decoding: the longest n-gram of a sequence's last tokens looked up in its
    earlier tokens; what followed its latest occurrence is the draft."""
    prompt_lookup_min: int = 2
    """Speculative decoding: the shortest n-gram looked up."""
    enable_lora: bool = False
    """Serve LoRA adapters (PEFT checkpoints) on the decoder's attention and MLP projections:
    each request may name its own (`lora_request`), and one step runs several adapters and the
    base model side by side."""
    max_loras: int = 4
    """LoRA: the most distinct adapters in one step; a request needing another waits."""
    max_lora_rank: int = 64
    """LoRA: the largest adapter rank accepted."""

    def __post_init__(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("block_size", self.block_size)
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.max_num_batched_tokens is not None:
            _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.kv_cache_memory_bytes is not None:
            _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        if self.num_threads is not None:
            _positive("num_threads", self.num_threads)
        _positive("max_loras", self.max_loras)
        _positive("max_lora_rank", self.max_lora_rank)
        _positive("prompt_lookup_min", self.prompt_lookup_min)
        _positive("prompt_lookup_max", self.prompt_lookup_max)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        speculative = self.num_speculative_tokens
        if not isinstance(speculative, int) or isinstance(speculative, bool) or speculative < 0:
            raise ValueError(f"num_speculative_tokens must be an integer >= 0, got {speculative!r}")
        if speculative and self.async_scheduling:
            raise ValueError(
                "speculative decoding (num_speculative_tokens) runs with synchronous "
                "scheduling: leave async_scheduling unset or off"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if not 0 < self.cpu_kv_cache_fraction < 1:
            raise ValueError(
                f"cpu_kv_cache_fraction must be in (0, 1), got {self.cpu_kv_cache_fraction}"
            )
        if self.dtype not in ("auto", "bfloat16", "float16", "float32", "half", "float"):
            raise ValueError(
                f"dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}"
            )
        if self.kv_cache_dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(
                "kv_cache_dtype must be auto, bfloat16, float16 or float32, got "
                f"{self.kv_cache_dtype!r}"
            )
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}"
            )
        if self.cpu_bf16_arithmetic not in ("auto", "bfloat16", "float32"):
            raise ValueError(
                "cpu_bf16_arithmetic must be auto, bfloat16 or float32, got "
                f"{self.cpu_bf16_arithmetic!r}"
            )


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


# vLLM's speculative_config keys for n-gram prompt lookup, all EngineConfig fields here.
_NGRAM_KEYS = frozenset({"num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"})


def speculation_fields(speculative_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """EngineConfig's speculation fields from vLLM's speculative_config (LLM's argument, the
    command line's --speculative-config JSON)."""
    if speculative_config is None:
        return {}
    given = dict(speculative_config)
    method = given.pop("method", "ngram")
    if method != "ngram":
        raise ValueError(
            f"speculative_config method {method!r} is not supported: vacpack drafts by n-gram "
            "prompt lookup ('ngram') only"
        )
    if "num_speculative_tokens" not in given:
        raise ValueError("speculative_config needs num_speculative_tokens")
    unknown = set(given) - _NGRAM_KEYS
    if unknown:
        raise ValueError(
            f"unknown speculative_config keys {sorted(unknown)}; known: {sorted(_NGRAM_KEYS)}"
        )
    return given


# Named as vLLM's class, which vLLM users construct the same way.
def EngineArgs(model: str, **engine_args: Any) -> EngineConfig:
    """An EngineConfig from keyword arguments as vLLM's `EngineArgs(...)` takes them: its fields,
    plus vLLM's `enforce_eager` (no CUDA graphs) and `speculative_config` dict. An unknown name
    is a TypeError that lists the known ones."""
    if "enforce_eager" in engine_args:
        enforce_eager = bool(engine_args.pop("enforce_eager"))
        engine_args.setdefault("enable_cuda_graphs", not enforce_eager)
    if "speculative_config" in engine_args:
        engine_args.update(speculation_fields(engine_args.pop("speculative_config")))
    known = {field.name for field in fields(EngineConfig)} - {"model"}
    unknown = set(engine_args) - known
    if unknown:
        raise TypeError(f"unknown engine arguments {sorted(unknown)}; known: {sorted(known)}")
    return EngineConfig(model=model, **engine_args)
