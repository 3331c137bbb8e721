"""vLLM's `use_beam_search` on the server: completions and chat answer each prompt's n best
beams, the same hypotheses as LLM.beam_search (itself checked against transformers), streamed or
not; fields a beam search cannot honour are refused; a client that leaves stops the search."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from server_process import ServerProcess, metric_value, running_server

from vacpack import LLM, BeamSearchParams, TokensPrompt

MAX_MODEL_LEN = 512
ENGINE_FLAGS = {"--dtype": "float32", "--max-model-len": str(MAX_MODEL_LEN), "--block-size": "8"}
PROMPTS = ["The weather today is", "A long time ago in a galaxy"]
WIDTH, MAX_TOKENS = 3, 6


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("qwen2"))


@pytest.fixture(scope="module")
def server(checkpoint: str) -> Iterator[ServerProcess]:
    flags = [part for pair in ENGINE_FLAGS.items() for part in pair]
    with running_server(checkpoint, *flags, "--served-model-name", "tiny") as process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0) as api:
        yield api


@pytest.fixture(scope="module")
def llm(checkpoint: str) -> LLM:
    return LLM(checkpoint, dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=8)


def _expected(llm: LLM, prompts: list[TokensPrompt], width: int) -> list[list[tuple[str, str]]]:
    outputs = llm.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS))
    return [[(beam.text or "", beam.finish_reason or "") for beam in o.sequences] for o in outputs]


def _token_prompts(llm: LLM, texts: list[str]) -> list[TokensPrompt]:
    tokenizer = llm.get_tokenizer()
    return [TokensPrompt(prompt_token_ids=tokenizer.encode(text)) for text in texts]


def test_completions_answer_each_prompt_s_best_beams(client: openai.OpenAI, llm: LLM) -> None:
    expected = _expected(llm, _token_prompts(llm, PROMPTS), WIDTH)
    extra = {"use_beam_search": True}
    response = client.completions.create(
        model="tiny", prompt=PROMPTS, n=WIDTH, max_tokens=MAX_TOKENS, extra_body=extra
    )
    choices = sorted(response.choices, key=lambda choice: choice.index)
    assert len(choices) == len(PROMPTS) * WIDTH
    got = [
        [(c.text, c.finish_reason) for c in choices[i * WIDTH : (i + 1) * WIDTH]]
        for i in range(len(PROMPTS))
    ]
    assert got == expected
    assert response.usage is not None and response.usage.completion_tokens > 0
    # Streamed: the same choices.
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(
        model="tiny",
        prompt=PROMPTS,
        n=WIDTH,
        max_tokens=MAX_TOKENS,
        stream=True,
        extra_body=extra,
    ):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[index] for index in range(len(choices))] == [c.text for c in choices]


def test_chat_answers_the_best_beams_of_its_rendered_messages(
    client: openai.OpenAI, llm: LLM, server: ServerProcess
) -> None:
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    rendered = httpx.post(
        f"{server.base_url}/tokenize", json={"model": "tiny", "messages": messages}
    ).json()["tokens"]
    expected = _expected(llm, [TokensPrompt(prompt_token_ids=rendered)], 2)[0]
    response = client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        n=2,
        max_tokens=MAX_TOKENS,
        extra_body={"use_beam_search": True},
    )
    got = [(c.message.content, c.finish_reason) for c in response.choices]
    assert got == expected


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"use_beam_search": True, "top_p": 0.5}, "top_p"),
        ({"use_beam_search": True, "temperature": 0.7}, "temperature"),
        ({"use_beam_search": True, "stop": ["x"]}, "stop"),
        ({"use_beam_search": True, "logprobs": 2}, "logprobs"),
        ({"use_beam_search": True, "n": 100}, "n"),
        ({"use_beam_search": True, "max_tokens": 0}, "max_tokens"),
        ({"length_penalty": 0.5}, "length_penalty"),
    ],
)
def test_what_a_beam_search_cannot_honour_is_refused(
    server: ServerProcess, fields: dict, param: str
) -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, **fields}
    response = httpx.post(f"{server.api_url}/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def _finished_requests(server: ServerProcess) -> float:
    """Engine requests finished so far, every finish reason's count added up."""
    metrics = httpx.get(f"{server.base_url}/metrics").text
    prefix = "vacpack:request_success_total{"
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(prefix)
    )


def test_a_client_that_leaves_stops_its_search(server: ServerProcess) -> None:
    max_tokens, width = MAX_MODEL_LEN - 16, 4
    body = {
        "model": "tiny",
        "prompt": PROMPTS[0],
        "n": width,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "use_beam_search": True,
    }
    finished_before = _finished_requests(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.api_url}/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 10
    while metric_value(
        httpx.get(f"{server.base_url}/metrics").text, "vacpack:num_requests_running"
    ):
        assert time.monotonic() < deadline, "the search went on after its client left"
        time.sleep(0.05)
    stopped_at = _finished_requests(server)
    time.sleep(0.5)
    # No later step started, and the search ended far from its (max_tokens - 1) x width requests.
    assert _finished_requests(server) == stopped_at
    assert stopped_at - finished_before < (max_tokens - 1) * width / 2
    # And the next request runs as usual.
    response = httpx.post(
        f"{server.api_url}/completions",
        json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "use_beam_search": True},
    )
    assert response.status_code == 200 and len(response.json()["choices"]) == 1
