"""A checkpoint loaded for inference: model, tokenizer, device and dtype, resolved once.

The generation engine and corpus jobs both start from a LoadedModel, so an LLM that only
embeds or scores never allocates a KV cache for generation, and one that does both loads its
weights once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from vacpack.attention import AttentionShapes
from vacpack.config import EngineConfig
from vacpack.cpu_kernels.cache_dtype import cache_dtype_readable
from vacpack.device import configure_threads, named_dtype, resolve_device, resolve_dtype
from vacpack.distributed.control import Program
from vacpack.distributed.driver import Driver
from vacpack.host_memory import keep_freed_host_memory
from vacpack.huge_pages import check_weights_in_huge_pages
from vacpack.models.base import PackedModel
from vacpack.models.cpu_dtype import (
    DTYPES,
    choose_bf16_arithmetic,
    choose_cpu_dtype,
    choose_weight_dtype,
    timed_linear_shape,
)
from vacpack.models.forward_context import attention_specs
from vacpack.models.hub import resolve_model_path
from vacpack.models.layer_ops_choice import LayerShapes, choose_layer_ops
from vacpack.models.linear_choice import LinearKernelChooser, ModelLinears
from vacpack.models.loader import LoadStats, checkpoint_dtype, load_hf_config, load_model_shard
from vacpack.models.parallel import SINGLE_RANK, TensorParallel, kv_head_rows
from vacpack.models.registry import model_class_for
from vacpack.tokenizer import eos_token_ids, load_tokenizer
from vacpack.tuning import ChoiceSource, MeasuredChoice, TimingAllowance, spending

NO_LOAD_STATS = LoadStats(0, 0)


@dataclass(frozen=True)
class LoadedModel:
    engine_config: EngineConfig
    model_dir: Path
    hf_config: PretrainedConfig
    model: PackedModel  # model.config is its family's config (a ModelConfig for decoders)
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: frozenset[int]
    device: torch.device
    dtype: torch.dtype  # the activations' and the arithmetic's
    kv_cache_dtype: torch.dtype  # `dtype`, or bfloat16 under float32 arithmetic on a CPU
    max_model_len: int
    # What was chosen by measurement at load (the dtype for dtype="auto" on a CPU, the layers'
    # elementwise ops), with the timings that chose it: for job reports and /metrics.
    measured_choices: tuple[MeasuredChoice, ...] = ()
    # This rank's shard of the model and its group (one rank: the whole model, no group).
    tp: TensorParallel = SINGLE_RANK
    # Rank 0 of a tensor-parallel group: runs device work in lockstep with the other ranks.
    driver: Driver | None = None
    load_stats: LoadStats = NO_LOAD_STATS
    # Rank 0 of a group: every rank's load_stats, in rank order.
    rank_load_stats: tuple[LoadStats, ...] = ()
    # The ledger of this load's measurements: the engine's and corpus runner's choices, made
    # later, are charged to it too, so that a first load's timing stays within one bound.
    timing_allowance: TimingAllowance = field(default_factory=TimingAllowance)
    # The linear layers' weights' and vocabulary tables' dtype where it is not `dtype`.
    weight_dtype: torch.dtype | None = None

    @property
    def dtype_description(self) -> str:
        """The dtypes, as reports give them ("bfloat16 weights and KV cache, float32
        arithmetic" where the weights or the cache are kept in another than the arithmetic's)."""
        return describe_dtypes(self.dtype, self.weight_dtype or self.dtype, self.kv_cache_dtype)

    @property
    def config(self) -> Any:  # the family's own config class: ModelConfig, EncoderConfig, ...
        return self.model.config

    @property
    def attention_shapes(self) -> AttentionShapes:
        """What attention backends are timed at for this model (attention/selection.py): this
        rank's heads."""
        config = self.config
        num_kv_heads = getattr(config, "num_kv_heads", config.num_heads)
        return AttentionShapes(
            num_heads=config.num_heads // self.tp.size,
            num_kv_heads=kv_head_rows(num_kv_heads, 1, self.tp).length,
            head_dim=config.head_dim,
            dtype=self.dtype,
            kv_cache_dtype=self.kv_cache_dtype,
            specs=attention_specs(self.model),
            max_model_len=self.max_model_len,
        )

    @property
    def is_decoder(self) -> bool:
        return bool(getattr(self.model, "is_decoder", False))

    @property
    def num_kv_heads(self) -> int:
        """The key/value heads this rank holds, the KV cache's heads."""
        return kv_head_rows(self.config.num_kv_heads, 1, self.tp).length

    def compute_logits(
        self, hidden: torch.Tensor, dtype: torch.dtype | None = torch.float32
    ) -> torch.Tensor:
        """The model's logits for `hidden`'s rows, for callers outside an engine step (corpus
        tasks). With tensor parallelism, rank 0 runs it as an LM_HEAD program: the other ranks
        receive the rows and project them onto their share of the vocabulary (payload: the
        number of rows)."""
        if self.driver is None:
            return self.model.compute_logits(hidden, dtype)
        assert self.tp.collectives is not None
        with self.driver.program(Program.LM_HEAD, [hidden.shape[0]]):
            self.tp.collectives.broadcast(hidden.to(self.dtype).contiguous())
            return self.model.compute_logits(hidden, dtype)


def _model_class(hf_config: PretrainedConfig) -> type[PackedModel] | None:
    """The family class the checkpoint loads as; None where it names none this package has
    (loading then says so)."""
    architectures = getattr(hf_config, "architectures", None) or []
    try:
        return model_class_for(architectures[0]) if architectures else None
    except ValueError:
        return None


def load(
    config: EngineConfig, tp: TensorParallel = SINGLE_RANK, driver: Driver | None = None
) -> LoadedModel:
    """The checkpoint loaded on this process's device: the whole model, or with `tp` this
    rank's shard of it (every rank of the group calls this at once). What it measures (dtype,
    layer ops, linear kernels) is charged to one timing allowance, kept on the result."""
    allowance = TimingAllowance()
    with spending(allowance):
        return _load(config, tp, driver, allowance)


def _load(
    config: EngineConfig, tp: TensorParallel, driver: Driver | None, allowance: TimingAllowance
) -> LoadedModel:
    device = resolve_device(config.device)
    configure_threads(device, config.num_threads)
    if device.type == "cpu":
        keep_freed_host_memory()
    model_dir = resolve_model_path(config.model, config.revision)
    hf_config = load_hf_config(model_dir, config.trust_remote_code)
    dtypes = resolve_load_dtype(config, hf_config, device)
    dtype, weight_dtype = dtypes.dtype, dtypes.weight_dtype
    kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, weight_dtype, device)
    tokenizer = load_tokenizer(
        config.tokenizer or str(model_dir),
        trust_remote_code=config.trust_remote_code,
        revision=config.revision,
    )
    # The elementwise ops the family's layers call are timed on its shapes.
    model_class = _model_class(hf_config)
    layer_ops_used = model_class.layer_ops_used if model_class else ()
    decoder_layers = bool(model_class and model_class.decoder_layers)
    layer_shapes = LayerShapes.from_hf(hf_config, dtype) if layer_ops_used else None
    layer_ops, layer_ops_choices = choose_layer_ops(device, layer_shapes, dtype, layer_ops_used)
    # Each linear weight shape's kernel is timed as the loader packs it.
    linears = ModelLinears.from_hf(
        hf_config,
        dtype,
        gated_mlp=decoder_layers,
        silu_and_mul=layer_ops.silu_and_mul,
        weight_dtype=weight_dtype,
    )
    linear_kernels = LinearKernelChooser(device, linears)
    model, load_stats = load_model_shard(
        model_dir,
        hf_config,
        dtype,
        device,
        layer_ops,
        tp,
        linear_kernels,
        weight_dtype,
        # LoRA adds its delta to the gate before the activation: the gate is not fused.
        gate_in_kernel=not config.enable_lora,
    )
    if device.type == "cpu":
        check_weights_in_huge_pages(load_stats.parameter_bytes)
    rank_load_stats: tuple[LoadStats, ...] = ()
    if tp.size > 1:
        assert tp.collectives is not None
        # Every rank takes part; rank 0 keeps the figures (tests and reports read them).
        gathered = tp.collectives.all_gather_ints(
            [load_stats.checkpoint_bytes_read, load_stats.parameter_bytes], device
        )
        rank_load_stats = tuple(LoadStats(*row) for row in gathered)
    # A RoPE scaling may stretch a decoder's context past max_position_embeddings.
    model_limit = getattr(model.config, "max_context_len", model.config.max_position_embeddings)
    max_model_len = _max_model_len(config, model_limit)
    model.limit_context(max_model_len)
    return LoadedModel(
        engine_config=config,
        model_dir=model_dir,
        hf_config=hf_config,
        model=model,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids(tokenizer, model_dir),
        device=device,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        max_model_len=max_model_len,
        measured_choices=(
            *dtypes.choices,
            *layer_ops_choices,
            *linear_kernels.choices,
        ),
        tp=tp,
        driver=driver,
        load_stats=load_stats,
        rank_load_stats=rank_load_stats if tp.rank == 0 else (),
        timing_allowance=allowance,
        weight_dtype=weight_dtype if weight_dtype != dtype else None,
    )


@dataclass(frozen=True)
class LoadDtypes:
    """What a model is loaded in, and the measurements that chose it."""

    dtype: torch.dtype  # the activations' and the arithmetic's
    # The linear layers' weights and the vocabulary tables': `dtype`, or bfloat16 with float32
    # arithmetic on a CPU without bfloat16 instructions (models/cpu_dtype.py).
    weight_dtype: torch.dtype
    choices: tuple[MeasuredChoice, ...] = ()


def describe_dtypes(
    dtype: torch.dtype, weight_dtype: torch.dtype, kv_cache_dtype: torch.dtype | None = None
) -> str:
    """The dtype's name, or where the weights or the KV cache are kept in another dtype, which
    ("bfloat16 weights and KV cache, float32 arithmetic"; "float32, bfloat16 KV cache")."""
    kv_cache_dtype = kv_cache_dtype or dtype
    name, weights, cache = (
        str(d).removeprefix("torch.") for d in (dtype, weight_dtype, kv_cache_dtype)
    )
    if weight_dtype == dtype:
        return name if kv_cache_dtype == dtype else f"{name}, {cache} KV cache"
    if kv_cache_dtype == weight_dtype:
        return f"{weights} weights and KV cache, {name} arithmetic"
    if kv_cache_dtype == dtype:
        return f"{weights} weights, {name} arithmetic"
    return f"{weights} weights, {cache} KV cache, {name} arithmetic"


def resolve_kv_cache_dtype(
    name: str, dtype: torch.dtype, weight_dtype: torch.dtype, device: torch.device
) -> torch.dtype:
    """The KV cache's dtype for EngineConfig.kv_cache_dtype `name`. auto: the weights' where
    attention can read it (a bfloat16 checkpoint computed in float32 on a CPU: its keys and
    values rounded as a bfloat16 model's are, at half the memory), else the model's."""
    if name == "auto":
        return weight_dtype if cache_dtype_readable(dtype, weight_dtype) else dtype
    chosen = named_dtype(name)
    if chosen == dtype or (device.type == "cpu" and cache_dtype_readable(dtype, chosen)):
        return chosen
    where = "on a CPU under float32 arithmetic" if device.type == "cpu" else "on a CPU"
    raise ValueError(
        f"kv_cache_dtype={name} with {str(dtype).removeprefix('torch.')} arithmetic on "
        f"{device.type}: the KV cache is kept in the model's dtype, or in bfloat16 {where}"
    )


def resolve_load_dtype(config: EngineConfig, hf_config: Any, device: torch.device) -> LoadDtypes:
    """The dtypes to load in. On a CPU, what is measured (models/cpu_dtype.py): for dtype
    auto, bfloat16 or float32, and for a bfloat16 checkpoint run in float32 the weights' dtype;
    for bfloat16 by name, the arithmetic (config.cpu_bf16_arithmetic; auto: measured)."""
    dtype_choice = _measured_cpu_dtype(config, hf_config, device)
    dtype = resolve_dtype(config.dtype, checkpoint_dtype(hf_config), device, dtype_choice)
    choices: tuple[MeasuredChoice, ...] = (dtype_choice,) if dtype_choice is not None else ()
    shape = timed_linear_shape(hf_config)
    if device.type != "cpu" or shape is None:
        return LoadDtypes(dtype, dtype, choices)
    # dtype auto took bfloat16 where its arithmetic is about as fast as float32's: it stays.
    if dtype == torch.bfloat16 and (config.dtype != "auto" or config.cpu_bf16_arithmetic != "auto"):
        forced = None if config.cpu_bf16_arithmetic == "auto" else config.cpu_bf16_arithmetic
        arithmetic = choose_bf16_arithmetic(shape, forced=forced)
        if arithmetic.source is not ChoiceSource.ONLY_CANDIDATE:
            choices += (arithmetic,)
        return LoadDtypes(DTYPES[arithmetic.chosen], dtype, choices)
    bf16_checkpoint = checkpoint_dtype(hf_config) == torch.bfloat16
    if config.dtype == "auto" and dtype == torch.float32 and bf16_checkpoint:
        weights = choose_weight_dtype(shape)
        if weights.source is not ChoiceSource.ONLY_CANDIDATE:
            choices += (weights,)
        return LoadDtypes(dtype, DTYPES[weights.chosen], choices)
    return LoadDtypes(dtype, dtype, choices)


def _measured_cpu_dtype(
    config: EngineConfig, hf_config: Any, device: torch.device
) -> MeasuredChoice | None:
    """bfloat16 or float32, timed at the model's shapes, where dtype is auto on a CPU."""
    if config.dtype != "auto" or device.type != "cpu":
        return None
    shape = timed_linear_shape(hf_config)
    return choose_cpu_dtype(shape) if shape is not None else None


def _max_model_len(config: EngineConfig, model_limit: int) -> int:
    requested = config.max_model_len
    if requested is not None and requested > model_limit:
        raise ValueError(
            f"max_model_len={requested} exceeds the model's context of {model_limit} tokens "
            "(max_position_embeddings, stretched by its RoPE scaling)"
        )
    return requested or model_limit
