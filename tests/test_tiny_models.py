"""The tiny random-weight checkpoints and the locally trained tokenizer."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from vacpack.testing.tiny_models import (
    FAMILIES,
    TOKENIZER_VOCAB_SIZE,
    TinyShape,
    build_random_checkpoint,
    build_tokenizer,
    load_sample_prompts,
    qwen2_5_0_5b_shapes,
)

# The `tiny_checkpoint` fixture from conftest.py: (family, **build kwargs) -> checkpoint dir.
TinyCheckpointFactory = Callable[..., Path]

# Text the tokenizer must reproduce byte for byte: multi-byte UTF-8 (accents, Greek, CJK, emoji,
# including characters absent from the training corpus), code indentation and special tokens.
ROUND_TRIP_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Crème brûlée in Zürich costs 12.50 €, naïve façade.",
    "Καλημέρα κόσμε! 你好，世界。こんにちは 🙂🦩🚀 ẞ ŋ",
    "def add(a: int, b: int) -> int:\n    return a + b\n\n\tindented\r\n  trailing  ",
    "<|im_start|>user\nHi there<|im_end|>\n<|endoftext|>",
    "",
)


def read_safetensors_tensors(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    tensors_by_name: dict[str, torch.Tensor] = {}
    for shard_path in sorted(checkpoint_dir.glob("*.safetensors")):
        with safe_open(str(shard_path), framework="pt") as shard:
            for tensor_name in shard.keys():  # noqa: SIM118 - safe_open is not a Mapping
                tensors_by_name[tensor_name] = shard.get_tensor(tensor_name)
    return tensors_by_name


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def test_tokenizer_has_the_planned_vocabulary_and_special_tokens(tokenizer_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert len(tokenizer) == TOKENIZER_VOCAB_SIZE
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        0,
        1,
        2,
    ]
    assert tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 0
    assert tokenizer.bos_token is None


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips_text(tokenizer_dir: Path, text: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(token_ids) == text


def test_tokenizer_keeps_special_tokens_whole_and_adds_none(tokenizer_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    token_ids = tokenizer.encode("<|im_start|>user\nhello<|im_end|>")
    assert token_ids[0] == 1
    assert token_ids[-1] == 2
    assert token_ids.count(0) == 0  # no eos or bos slipped in


def test_tokenizer_training_is_deterministic(tokenizer_dir: Path, tmp_path: Path) -> None:
    rebuilt_dir = build_tokenizer(tmp_path)
    original_json = (tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8")
    assert (rebuilt_dir / "tokenizer.json").read_text(encoding="utf-8") == original_json


def test_chat_template_renders_chatml(tokenizer_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without_prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    assert without_prompt == rendered.removesuffix("<|im_start|>assistant\n")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_builds_and_loads_back(
    tiny_checkpoint: TinyCheckpointFactory, family: str
) -> None:
    checkpoint_dir = tiny_checkpoint(family)
    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir)
    config = model.config
    shape = TinyShape()
    assert config.model_type == FAMILIES[family].model_type
    assert config.vocab_size == TOKENIZER_VOCAB_SIZE
    assert config.hidden_size == shape.hidden_size
    assert config.num_hidden_layers == shape.num_hidden_layers
    assert config.num_attention_heads == shape.num_attention_heads
    assert config.num_key_value_heads == shape.num_key_value_heads
    assert config.head_dim == shape.head_dim
    assert config.intermediate_size == shape.intermediate_size
    assert config.max_position_embeddings == shape.max_position_embeddings
    assert config.eos_token_id == 0
    assert model.dtype == torch.float32
    expect_tied = FAMILIES[family].ties_word_embeddings_by_default
    assert config.tie_word_embeddings is expect_tied
    saved_names = read_safetensors_tensors(checkpoint_dir).keys()
    assert ("lm_head.weight" in saved_names) is not expect_tied
    assert (checkpoint_dir / "tokenizer.json").is_file()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generation_config_names_the_tokenizer_eos(
    tiny_checkpoint: TinyCheckpointFactory, family: str
) -> None:
    checkpoint_dir = tiny_checkpoint(family)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
    generation_config = GenerationConfig.from_pretrained(checkpoint_dir)
    assert generation_config.eos_token_id == tokenizer.eos_token_id == 0


def test_llama3_rope_scaling_is_saved_and_active_after_reload(
    tiny_checkpoint: TinyCheckpointFactory,
) -> None:
    checkpoint_dir = tiny_checkpoint("llama3")
    saved_config = json.loads((checkpoint_dir / "config.json").read_text(encoding="utf-8"))
    # transformers 5 writes `rope_parameters` (with rope_theta inside); 4.x wrote `rope_scaling`.
    saved_rope = saved_config.get("rope_parameters") or saved_config["rope_scaling"]
    assert saved_rope["rope_type"] == "llama3"
    assert saved_rope["factor"] == 8.0
    assert saved_rope["original_max_position_embeddings"] == 64

    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir)
    rotary = model.model.rotary_emb
    assert rotary.rope_type == "llama3"
    head_dim = model.config.head_dim
    unscaled_inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    # llama3 scaling leaves the fastest frequency alone and slows down the slowest ones.
    assert torch.allclose(rotary.inv_freq[0], unscaled_inv_freq[0])
    assert torch.allclose(rotary.inv_freq[-1], unscaled_inv_freq[-1] / 8.0)


def test_plain_llama_has_default_rope(tiny_checkpoint: TinyCheckpointFactory) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama"))
    assert model.model.rotary_emb.rope_type == "default"


def test_qwen2_has_random_qkv_biases(tiny_checkpoint: TinyCheckpointFactory) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("qwen2"))
    attention = model.model.layers[0].self_attn
    for projection in (attention.q_proj, attention.k_proj, attention.v_proj):
        assert projection.bias is not None
        assert projection.bias.std() > 0.05  # random, so the bias path changes the output
    assert attention.o_proj.bias is None


def test_qwen3_has_qk_norms_and_explicit_head_dim(tiny_checkpoint: TinyCheckpointFactory) -> None:
    checkpoint_dir = tiny_checkpoint("qwen3")
    tensors_by_name = read_safetensors_tensors(checkpoint_dir)
    q_norm_scale = tensors_by_name["model.layers.0.self_attn.q_norm.weight"]
    assert q_norm_scale.shape == (TinyShape().head_dim,)
    assert "model.layers.1.self_attn.k_norm.weight" in tensors_by_name
    assert not torch.all(q_norm_scale == 1.0)  # random around 1, not the identity
    assert AutoConfig.from_pretrained(checkpoint_dir).head_dim == TinyShape().head_dim


def test_tie_word_embeddings_override(tiny_checkpoint: TinyCheckpointFactory) -> None:
    tied_llama_dir = tiny_checkpoint("llama", tie_word_embeddings=True)
    untied_qwen2_dir = tiny_checkpoint("qwen2", tie_word_embeddings=False)
    assert "lm_head.weight" not in read_safetensors_tensors(tied_llama_dir)
    assert "lm_head.weight" in read_safetensors_tensors(untied_qwen2_dir)
    model = AutoModelForCausalLM.from_pretrained(untied_qwen2_dir)
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_sharded_save_writes_an_index_and_the_same_weights(
    tiny_checkpoint: TinyCheckpointFactory,
) -> None:
    sharded_dir = tiny_checkpoint("llama", max_shard_bytes=300_000)
    shard_paths = sorted(sharded_dir.glob("*.safetensors"))
    assert len(shard_paths) > 1
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text(encoding="utf-8"))
    assert set(index["weight_map"].values()) == {path.name for path in shard_paths}

    sharded_tensors = read_safetensors_tensors(sharded_dir)
    single_file_tensors = read_safetensors_tensors(tiny_checkpoint("llama"))
    assert set(index["weight_map"]) == set(sharded_tensors) == set(single_file_tensors)
    for tensor_name, tensor in single_file_tensors.items():
        assert torch.equal(sharded_tensors[tensor_name], tensor), tensor_name


def test_seed_changes_the_weights(tiny_checkpoint: TinyCheckpointFactory) -> None:
    seed0_tensors = read_safetensors_tensors(tiny_checkpoint("mistral"))
    seed1_tensors = read_safetensors_tensors(tiny_checkpoint("mistral", seed=1))
    embedding_name = "model.embed_tokens.weight"
    assert not torch.equal(seed0_tensors[embedding_name], seed1_tensors[embedding_name])


def test_config_overrides_and_dtype(tiny_checkpoint: TinyCheckpointFactory) -> None:
    checkpoint_dir = tiny_checkpoint("qwen2", dtype=torch.bfloat16, num_hidden_layers=3)
    config = AutoConfig.from_pretrained(checkpoint_dir)
    assert config.num_hidden_layers == 3
    saved_config = json.loads((checkpoint_dir / "config.json").read_text(encoding="utf-8"))
    # transformers 5 names the field `dtype`; 4.x named it `torch_dtype`.
    assert saved_config.get("dtype", saved_config.get("torch_dtype")) == "bfloat16"
    tensors_by_name = read_safetensors_tensors(checkpoint_dir)
    assert "model.layers.2.mlp.up_proj.weight" in tensors_by_name
    assert {tensor.dtype for tensor in tensors_by_name.values()} == {torch.bfloat16}


def test_logits_are_spread_out_for_greedy_decoding(tiny_checkpoint: TinyCheckpointFactory) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("qwen2"))
    token_ids = torch.arange(3, 3 + 48).unsqueeze(0) * 37 % TOKENIZER_VOCAB_SIZE
    with torch.no_grad():
        logits = model(token_ids).logits[0]
    top_two_logits = logits.topk(2, dim=-1).values
    top_two_gaps = top_two_logits[:, 0] - top_two_logits[:, 1]
    assert logits.std() > 1.0
    assert top_two_gaps.median() > 0.1


def test_qwen2_5_0_5b_shapes_match_the_real_parameter_count() -> None:
    config = AutoConfig.for_model("qwen2", **qwen2_5_0_5b_shapes())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # parameters() yields the tied embedding once, as the published figure counts it.
    parameter_count = sum(parameter.numel() for parameter in model.parameters())
    assert parameter_count == 494_032_768
    # transformers 5 keeps rope_theta inside rope_parameters; 4.x kept it as a top-level field.
    rope_parameters = getattr(config, "rope_parameters", None) or {"rope_theta": config.rope_theta}
    assert rope_parameters["rope_theta"] == 1000000.0
    assert config.tie_word_embeddings is True


def test_random_checkpoint_keeps_its_own_vocab_and_dtype(tmp_path: Path) -> None:
    small_shapes = {**TinyShape().as_config_kwargs(), "vocab_size": 4096}
    checkpoint_dir = build_random_checkpoint(small_shapes, "qwen2", tmp_path)
    config = AutoConfig.from_pretrained(checkpoint_dir)
    assert config.vocab_size == 4096
    assert len(AutoTokenizer.from_pretrained(checkpoint_dir)) == TOKENIZER_VOCAB_SIZE
    tensors_by_name = read_safetensors_tensors(checkpoint_dir)
    embedding = tensors_by_name["model.embed_tokens.weight"]
    assert embedding.dtype == torch.bfloat16
    assert embedding.shape == (4096, TinyShape().hidden_size)
    assert 0.015 < embedding.float().std() < 0.025
    assert GenerationConfig.from_pretrained(checkpoint_dir).eos_token_id == 0


def test_sample_prompts_are_varied() -> None:
    prompts = load_sample_prompts()
    assert len(prompts) == 32
    assert len(set(prompts)) == 32
    prompt_lengths = sorted(len(prompt) for prompt in prompts)
    assert prompt_lengths[0] < 40
    assert prompt_lengths[-1] > 400
