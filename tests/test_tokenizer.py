"""Tests for vacpack.tokenizer: loading, eos ids and chat templates."""

from __future__ import annotations

import json
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from transformers import BatchEncoding, PreTrainedTokenizerBase

from vacpack.tokenizer import (
    TokenizerLoadError,
    TokenizerNotFoundError,
    apply_chat_template,
    eos_token_ids,
    load_tokenizer,
)

# ---------------------------------------------------------------- loading


def test_load_missing_local_path_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(TokenizerNotFoundError) as raised:
        load_tokenizer(str(missing))
    message = str(raised.value)
    assert str(missing) in message
    assert "neither a local directory nor available offline" in message
    assert isinstance(raised.value, ValueError)


def test_load_file_path_is_not_a_model(tmp_path: Path) -> None:
    a_file = tmp_path / "tokenizer.json"
    a_file.write_text("{}")
    with pytest.raises(TokenizerNotFoundError, match="neither a local directory"):
        load_tokenizer(str(a_file))


def test_load_unknown_hub_id_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    # Offline mode keeps the test from waiting on network retries.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    repo_id = "vacpack-tests/no-such-model-7f3a"
    with pytest.raises(ValueError, match="neither a local directory nor available offline") as e:
        load_tokenizer(repo_id)
    assert repo_id in str(e.value)


def test_load_empty_directory_says_it_is_a_directory(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match="local directory") as raised:
        load_tokenizer(str(tmp_path))
    assert not isinstance(raised.value, TokenizerNotFoundError)
    assert str(tmp_path) in str(raised.value)


def test_load_local_directories(bpe: PreTrainedTokenizerBase, bert) -> None:
    assert bpe.encode("hello world")
    assert bpe.decode(bpe.encode("café 中文 😀")) == "café 中文 😀"
    assert bert.convert_ids_to_tokens(bert.encode("hello"))[0] == "[CLS]"


# ---------------------------------------------------------------- eos ids


def _write_generation_config(model_dir: Path, eos_token_id: object) -> None:
    config = {"eos_token_id": eos_token_id, "transformers_version": "5.0.0"}
    (model_dir / "generation_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("generation_eos", "expected"),
    [([0, 2], {0, 2}), (2, {0, 2}), (0, {0}), (None, {0}), ([], {0})],
)
def test_eos_ids_union_with_generation_config(
    bpe: PreTrainedTokenizerBase, tmp_path: Path, generation_eos: object, expected: set[int]
) -> None:
    assert bpe.eos_token_id == 0
    _write_generation_config(tmp_path, generation_eos)
    assert eos_token_ids(bpe, tmp_path) == frozenset(expected)
    assert eos_token_ids(bpe, str(tmp_path)) == frozenset(expected)


def test_eos_ids_without_generation_config(bpe: PreTrainedTokenizerBase, tmp_path: Path) -> None:
    assert eos_token_ids(bpe, None) == frozenset({0})
    assert eos_token_ids(bpe, tmp_path) == frozenset({0})


def test_eos_ids_tokenizer_without_eos(bert: PreTrainedTokenizerBase, tmp_path: Path) -> None:
    assert eos_token_ids(bert, None) == frozenset()
    _write_generation_config(tmp_path, [102])
    assert eos_token_ids(bert, tmp_path) == frozenset({102})


def test_eos_ids_rejects_malformed_config(bpe: PreTrainedTokenizerBase, tmp_path: Path) -> None:
    _write_generation_config(tmp_path, ["<|endoftext|>"])
    with pytest.raises(ValueError, match=r"generation_config\.json"):
        eos_token_ids(bpe, tmp_path)


# ---------------------------------------------------------------- chat template

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say café 中文 😀"},
]


def test_chat_template_token_ids(bpe: PreTrainedTokenizerBase) -> None:
    token_ids = apply_chat_template(bpe, CONVERSATION)
    rendered = bpe.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    assert isinstance(token_ids, list)
    assert all(type(token_id) is int for token_id in token_ids)
    assert token_ids == bpe.encode(rendered, add_special_tokens=False)
    assert token_ids[0] == bpe.convert_tokens_to_ids("<|im_start|>")
    without_prompt = apply_chat_template(bpe, CONVERSATION, add_generation_prompt=False)
    assert token_ids[: len(without_prompt)] == without_prompt
    assert len(without_prompt) < len(token_ids)


def test_chat_template_missing_is_a_clear_error(bert: PreTrainedTokenizerBase) -> None:
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(bert, CONVERSATION)


def test_chat_template_given_explicitly(bert: PreTrainedTokenizerBase) -> None:
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
    token_ids = apply_chat_template(bert, CONVERSATION, chat_template=template)
    text = bert.decode(token_ids)
    assert text.startswith("system : be brief.")


class _StubChatTokenizer:
    """Returns a fixed object from apply_chat_template, as various transformers versions do."""

    name_or_path = "stub"
    chat_template = "unused"

    def __init__(self, template_output: object) -> None:
        self._template_output = template_output

    def apply_chat_template(self, conversation: object, **kwargs: object) -> object:
        return self._template_output


@pytest.mark.parametrize(
    "template_output",
    [
        [5, 6, 7],
        [[5, 6, 7]],
        BatchEncoding({"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1]}),
        {"input_ids": [[5, 6, 7]]},
        torch.tensor([[5, 6, 7]]),
    ],
    ids=["list", "nested", "batch_encoding", "dict_nested", "tensor"],
)
def test_chat_template_output_shapes(template_output: object) -> None:
    stub = _StubChatTokenizer(template_output)
    assert apply_chat_template(stub, CONVERSATION) == [5, 6, 7]  # type: ignore[arg-type]
