"""The engine's command-line flags are generated from EngineConfig: every field, its default
and its help text, on every command that loads a model."""

from __future__ import annotations

import dataclasses

import pytest

from vacpack.cli import build_parser
from vacpack.cli.engine_args import engine_kwargs, field_docs
from vacpack.config import EngineConfig

COMMANDS_WITH_ENGINE = ["generate", "embed", "loglikelihood", "classify", "serve", "run-batch"]
# A value unlike each field's default, written as a user would on the command line.
FLAG_VALUES = {
    "tokenizer": ("--tokenizer", "tok-dir", "tok-dir"),
    "revision": ("--revision", "v2", "v2"),
    "trust_remote_code": ("--trust-remote-code", None, True),
    "dtype": ("--dtype", "float32", "float32"),
    "cpu_bf16_arithmetic": ("--cpu-bf16-arithmetic", "float32", "float32"),
    "device": ("--device", "cpu", "cpu"),
    "max_model_len": ("--max-model-len", "512", 512),
    "max_num_seqs": ("--max-num-seqs", "7", 7),
    "max_num_batched_tokens": ("--max-num-batched-tokens", "96", 96),
    "block_size": ("--block-size", "8", 8),
    "enable_prefix_caching": ("--no-enable-prefix-caching", None, False),
    "seed": ("--seed", "5", 5),
    "generation_config": ("--generation-config", "vllm", "vllm"),
    "kv_cache_dtype": ("--kv-cache-dtype", "bfloat16", "bfloat16"),
    "kv_cache_memory_bytes": ("--kv-cache-memory-bytes", "1048576", 1 << 20),
    "gpu_memory_utilization": ("--gpu-memory-utilization", "0.5", 0.5),
    "cpu_kv_cache_fraction": ("--cpu-kv-cache-fraction", "0.25", 0.25),
    "attention_backend": ("--attention-backend", "torch_sdpa", "torch_sdpa"),
    "async_scheduling": ("--async-scheduling", None, True),
    "scheduling_policy": ("--scheduling-policy", "priority", "priority"),
    "enable_cuda_graphs": ("--no-enable-cuda-graphs", None, False),
    "num_threads": ("--num-threads", "1", 1),
    "tensor_parallel_size": ("--tensor-parallel-size", "2", 2),
    "num_speculative_tokens": ("--num-speculative-tokens", "0", 0),
    "prompt_lookup_max": ("--prompt-lookup-max", "5", 5),
    "prompt_lookup_min": ("--prompt-lookup-min", "3", 3),
    "enable_lora": ("--enable-lora", None, True),
    "max_loras": ("--max-loras", "2", 2),
    "max_lora_rank": ("--max-lora-rank", "32", 32),
}


def _argv(command: str, flags: list[str]) -> list[str]:
    extra = {"embed": ["--input", "x"], "loglikelihood": ["--input", "x"]}
    extra |= {"classify": ["--input", "x"], "run-batch": ["-i", "x", "-o", "y"]}
    return [command, "--model", "m", *extra.get(command, []), *flags]


def test_every_field_has_a_flag_a_value_above_and_a_help_text() -> None:
    names = {field.name for field in dataclasses.fields(EngineConfig)} - {"model"}
    assert names == set(FLAG_VALUES), "a field without a value in this test, or a stale one"
    docs = field_docs(EngineConfig)
    assert all(docs.get(name) for name in names | {"model"}), "a field without a docstring"


@pytest.mark.parametrize("command", COMMANDS_WITH_ENGINE)
def test_defaults_are_the_config_defaults(command: str) -> None:
    args = build_parser().parse_args(_argv(command, []))
    assert EngineConfig(model="m", **engine_kwargs(args)) == EngineConfig(model="m")


@pytest.mark.parametrize("command", COMMANDS_WITH_ENGINE)
def test_every_field_is_settable(command: str) -> None:
    flags: list[str] = []
    for flag, text, _ in FLAG_VALUES.values():
        flags += [flag] if text is None else [flag, text]
    kwargs = engine_kwargs(build_parser().parse_args(_argv(command, flags)))
    assert kwargs == {name: value for name, (_, _, value) in FLAG_VALUES.items()}
    EngineConfig(model="m", **kwargs)  # and they make a valid config


def test_help_shows_the_field_docs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--cpu-kv-cache-fraction" in help_text
    assert "the share of the RAM available after loading the model" in help_text


def test_vllms_speculative_config_flag_sets_the_speculation_fields() -> None:
    flag = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 6}'
    args = build_parser().parse_args(_argv("serve", ["--speculative-config", flag]))
    kwargs = engine_kwargs(args)
    assert (kwargs["num_speculative_tokens"], kwargs["prompt_lookup_max"]) == (3, 6)
    with pytest.raises(ValueError, match="method 'eagle' is not supported"):
        engine_kwargs(
            build_parser().parse_args(
                _argv("serve", ["--speculative-config", '{"method": "eagle"}'])
            )
        )
