"""DecodeGraphRunner: padded static-buffer decode steps equal eager ones.

On a CPU the runner runs its static-buffer path eagerly (capture=False) with the Triton kernels
in the interpreter (tests/conftest.py switches it on); on a GPU it also
captures and replays CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn
from triton_marks import ON_CPU, TRITON_RUNS

pytest.importorskip("triton")
pytestmark = TRITON_RUNS

from vacpack.attention import BatchLayout, create_backend  # noqa: E402
from vacpack.engine.cuda_graphs import DecodeGraphRunner, decode_buckets  # noqa: E402
from vacpack.kvcache.paged_cache import PagedKVCache  # noqa: E402
from vacpack.models.forward_context import ForwardContext  # noqa: E402
from vacpack.models.loader import load_hf_config, load_model  # noqa: E402

PAGE_SIZE = 4
MAX_NUM_SEQS = 8  # buckets 1, 2, 4, 8
MAX_PAGES_PER_SEQ = 8
NUM_PAGES = 48
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@dataclass(frozen=True)
class DecodeStep:
    token_ids: torch.Tensor
    positions: torch.Tensor
    layout: BatchLayout


def _load(model_dir: Path, device: torch.device) -> nn.Module:
    return load_model(model_dir, load_hf_config(model_dir), torch.float32, device)


def _forward(
    model: nn.Module, backend_name: str, cache: PagedKVCache, step: DecodeStep
) -> torch.Tensor:
    backend = create_backend(backend_name)
    metadata = backend.build_metadata(step.layout, step.token_ids.device)
    return model(step.token_ids, step.positions, ForwardContext(backend, metadata, cache))


def _clone(cache: PagedKVCache) -> PagedKVCache:
    copy = PagedKVCache(
        cache.keys.shape[0], cache.num_pages, cache.page_size, cache.keys.shape[2],
        cache.keys.shape[3], cache.keys.dtype, cache.keys.device,
    )  # fmt: skip
    copy.keys.copy_(cache.keys)
    copy.values.copy_(cache.values)
    return copy


def _prefilled(
    model: nn.Module, prompt_lens: list[int], device: torch.device, seed: int = 0
) -> tuple[PagedKVCache, DecodeStep]:
    """A cache holding prompts of these lengths (prefilled eagerly), and their next decode step."""
    config = model.config
    cache = PagedKVCache(
        config.num_layers, NUM_PAGES, PAGE_SIZE, config.num_kv_heads, config.head_dim,
        torch.float32, device,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    pages = torch.randperm(NUM_PAGES, generator=generator).tolist()
    # Room for the decoded token: a prompt ending on a page edge needs one more page.
    page_tables = [[pages.pop() for _ in range(n // PAGE_SIZE + 1)] for n in prompt_lens]
    prompt_ids = torch.randint(0, config.vocab_size, (sum(prompt_lens),), generator=generator)
    prefill = DecodeStep(
        prompt_ids.to(device),
        torch.cat([torch.arange(n) for n in prompt_lens]).to(device),
        BatchLayout(prompt_lens, prompt_lens, page_tables, PAGE_SIZE),
    )
    _forward(model, "torch_sdpa", cache, prefill)
    num_seqs = len(prompt_lens)
    decode = DecodeStep(
        torch.randint(0, config.vocab_size, (num_seqs,), generator=generator).to(device),
        torch.tensor(prompt_lens).to(device),
        BatchLayout([1] * num_seqs, [n + 1 for n in prompt_lens], page_tables, PAGE_SIZE),
    )
    return cache, decode


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama3")


def test_buckets() -> None:
    assert decode_buckets(1) == [1]
    assert decode_buckets(5) == [1, 2, 4, 5]
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert decode_buckets(45) == [1, 2, 4, 8, 16, 24, 32, 40, 45]


@ON_CPU
@pytest.mark.parametrize("prompt_lens", [[3, 8, 13], [1, 5, 11, 4, 20]])
@torch.inference_mode()
def test_padded_static_decode_equals_eager(model_dir: Path, prompt_lens: list[int]) -> None:
    cpu = torch.device("cpu")
    model = _load(model_dir, cpu)
    cache, step = _prefilled(model, prompt_lens, cpu)
    eager_cache = _clone(cache)
    expected = _forward(model, "torch_sdpa", eager_cache, step)

    runner = DecodeGraphRunner(
        model, cache, create_backend("triton"), MAX_NUM_SEQS, MAX_PAGES_PER_SEQ, cpu, capture=False
    )
    result = runner.run(step.token_ids, step.positions, step.layout)
    assert result is not None
    hidden, num_padded = result
    num_seqs = len(prompt_lens)
    assert num_padded == runner.bucket_for(num_seqs) - num_seqs > 0
    torch.testing.assert_close(hidden, expected, atol=1e-4, rtol=1e-4)
    # The dummy rows wrote only to the scratch page; every sequence's slots match eager.
    scratch = cache.scratch_slot
    torch.testing.assert_close(cache.keys[:, :scratch], eager_cache.keys[:, :scratch])
    torch.testing.assert_close(cache.values[:, :scratch], eager_cache.values[:, :scratch])
    assert cache.keys[:, scratch].abs().sum() > 0


@torch.inference_mode()
def test_steps_the_buffers_cannot_hold_fall_back_to_eager(model_dir: Path) -> None:
    cpu = torch.device("cpu")
    model = _load(model_dir, cpu)
    cache, step = _prefilled(model, [3, 6], cpu)
    runner = DecodeGraphRunner(
        model, cache, create_backend("triton"), MAX_NUM_SEQS, MAX_PAGES_PER_SEQ, cpu, capture=False
    )
    mixed = BatchLayout([1, 2], [4, 7], step.layout.page_tables, PAGE_SIZE)
    assert runner.run(step.token_ids, step.positions, mixed) is None
    too_many = BatchLayout([1] * 9, [1] * 9, [[0]] * 9, PAGE_SIZE)
    nine = torch.zeros(9, dtype=torch.int64)
    assert runner.run(nine, nine, too_many) is None
    too_long = BatchLayout([1], [MAX_PAGES_PER_SEQ * PAGE_SIZE + 1], [list(range(9))], PAGE_SIZE)
    assert runner.run(step.token_ids[:1], step.positions[:1], too_long) is None
    portable = DecodeGraphRunner(
        model, cache, create_backend("torch_sdpa"), MAX_NUM_SEQS, MAX_PAGES_PER_SEQ, cpu, True
    )
    assert not portable.enabled
    assert portable.run(step.token_ids, step.positions, step.layout) is None


@needs_gpu
@torch.inference_mode()
def test_graph_replay_equals_eager_on_cuda(model_dir: Path) -> None:
    cuda = torch.device("cuda")
    model = _load(model_dir, cuda)
    # Captured once; replayed for batches of different sizes and contexts.
    cache, _ = _prefilled(model, [1], cuda)
    runner = DecodeGraphRunner(
        model, cache, create_backend("triton"), MAX_NUM_SEQS, MAX_PAGES_PER_SEQ, cuda, True
    )
    assert sorted(runner.graphs) == decode_buckets(MAX_NUM_SEQS)
    for seed, prompt_lens in enumerate([[3, 8, 13], [1, 5, 11, 4, 20], [30], [2] * 8]):
        fresh, step = _prefilled(model, prompt_lens, cuda, seed)
        cache.keys.copy_(fresh.keys)
        cache.values.copy_(fresh.values)
        eager_cache = _clone(cache)
        expected = _forward(model, "triton", eager_cache, step)
        result = runner.run(step.token_ids, step.positions, step.layout)
        assert result is not None
        hidden, num_padded = result
        assert num_padded == runner.bucket_for(len(prompt_lens)) - len(prompt_lens)
        torch.testing.assert_close(hidden, expected, atol=1e-4, rtol=1e-4)
        scratch = cache.scratch_slot
        torch.testing.assert_close(cache.keys[:, :scratch], eager_cache.keys[:, :scratch])


def _greedy_tokens(llm, prompts: list[list[int]]) -> list[list[int]]:
    from vacpack import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _engine_llm(model_dir: Path, device: str, **kwargs):
    from vacpack import LLM

    return LLM(
        str(model_dir), dtype="float32", device=device, block_size=PAGE_SIZE,
        max_num_batched_tokens=16, max_num_seqs=MAX_NUM_SEQS, max_model_len=32, **kwargs,
    )  # fmt: skip


def _prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in (3, 9, 5)]


@ON_CPU
def test_the_engine_runs_decode_steps_through_the_graph_runner(model_dir: Path) -> None:
    """On a CPU: the runner's static-buffer path (what a graph replays) inside the async engine
    gives the portable backend's greedy tokens, and its padding reaches the timeline."""
    reference = _engine_llm(model_dir, "cpu", attention_backend="torch_sdpa")
    prompts = _prompts(reference.loaded.config.vocab_size)
    llm = _engine_llm(model_dir, "cpu", attention_backend="triton", async_scheduling=True)
    engine = llm.engine
    engine.runner.forward.graph_runner = DecodeGraphRunner(
        engine.loaded.model, engine.kv_cache, engine.attention, MAX_NUM_SEQS, MAX_PAGES_PER_SEQ,
        engine.loaded.device, capture=False,
    )  # fmt: skip
    assert _greedy_tokens(llm, prompts) == _greedy_tokens(reference, prompts)
    summary = engine.timeline.summary()
    assert summary.num_padded_slots > 0  # 3 sequences run in the bucket of 4


@needs_gpu
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_cuda_engine_equals_portable_eager(model_dir: Path, async_scheduling: bool) -> None:
    """The CUDA defaults (Triton attention, decode graphs) with overlap on and off, against
    the portable backend run eagerly and synchronously on the same GPU."""
    reference = _engine_llm(
        model_dir, "cuda", attention_backend="torch_sdpa", enable_cuda_graphs=False,
        async_scheduling=False,
    )  # fmt: skip
    prompts = _prompts(reference.loaded.config.vocab_size)
    llm = _engine_llm(model_dir, "cuda", async_scheduling=async_scheduling)
    attention = llm.engine.attention
    assert getattr(attention, "decode", attention).name == "triton"  # decodes: Triton, in graphs
    assert llm.engine.runner.forward.graph_runner is not None
    assert _greedy_tokens(llm, prompts) == _greedy_tokens(reference, prompts)
    assert llm.engine.timeline.summary().num_padded_slots > 0
