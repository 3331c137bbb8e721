"""Bad requests get OpenAI error bodies with the right status; nothing stalls the server.

Also: many concurrent streams, clients that leave (mid-stream, mid-body, all at once: no page
or sequence is left behind), a full waiting queue (503), and a graceful SIGTERM, whose requests
still running when the drain is up end with a 503 (a stream: an error event, then [DONE]).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import json
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_process import ServerProcess, metric_value, running_server

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 1024
LONG_PROMPT_IDS = [5] * (MAX_MODEL_LEN + 10)
LONG_TEXT = "the river runs past the mill " * MAX_MODEL_LEN  # a token a word, at least
MAX_N = 16
MAX_SEQUENCES = 64  # the 64 concurrent streams test sends 64 prompts in one request
MAX_BODY_BYTES = 4 << 20
NESTED_100K = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
NESTED_TEXT = "[" * 100_000 + "]" * 100_000  # JSON text, nested 100,000 deep
# A lone surrogate is valid JSON ("\\ud800" with no pair after it), but not Unicode; bytes,
# because a client library encoding the text itself would refuse it.
LONE_SURROGATE = b'"hi \\ud800"'
TOOLS = [{"type": "function", "function": {"name": "get_weather"}}]


@pytest.fixture(scope="module")
def server(tiny_checkpoint) -> Iterator[ServerProcess]:
    with running_server(
        tiny_checkpoint("qwen2"),
        "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-cache-memory-bytes", str(8 << 20),
        "--served-model-name", "tiny",
        "--max-n", str(MAX_N),
        "--max-sequences-per-request", str(MAX_SEQUENCES),
        "--max-request-body-bytes", str(MAX_BODY_BYTES),
        env={"VACPACK_API_KEY": API_KEY},
    ) as process:  # fmt: skip
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=30.0) as http:
        yield http


def _completion(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "hello", "max_tokens": 2, **fields}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}


def _earlier_call(function: Any) -> dict[str, Any]:
    """A chat whose assistant turn called a tool as `function` says."""
    call = {"id": "c", "type": "function", "function": function}
    return _chat(
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c", "content": "4"},
        ]
    )


def _with_lone_surrogate(template: bytes) -> bytes:
    return template.replace(b"TEXT", LONE_SURROGATE)


C, CHAT, EMB = "/v1/completions", "/v1/chat/completions", "/v1/embeddings"
# (name, method, path, body (dict, or raw bytes), status, param at fault, words in the message)
BAD_REQUESTS = [
    ("malformed JSON", "POST", C, b'{"prompt": "hi", ', 400, None, "not valid JSON"),
    ("body not an object", "POST", C, b"[1, 2]", 400, None, "JSON object"),
    ("missing prompt", "POST", C, {"model": "tiny"}, 400, "prompt", "required"),
    ("prompt of wrong type", "POST", C, _completion(prompt=5), 400, "prompt", "must be"),
    ("max_tokens a string", "POST", C, _completion(max_tokens="8"), 400, "max_tokens", "integer"),
    ("negative max_tokens", "POST", C, _completion(max_tokens=-1), 400, "max_tokens", ">= 0"),
    ("temperature < 0", "POST", C, _completion(temperature=-0.5), 400, "temperature", ">= 0"),
    ("top_p > 1", "POST", C, _completion(top_p=1.5), 400, "top_p", "(0, 1]"),
    ("n = 0", "POST", C, _completion(n=0), 400, "n", ">= 1"),
    ("n a bool", "POST", C, _completion(n=True), 400, "n", "integer"),
    ("priority under fcfs", "POST", C, _completion(priority=3), 400, "priority", "not enabled"),
    ("too many logprobs", "POST", C, _completion(logprobs=50), 400, "logprobs", "20"),
    # Found only when the engine takes the request (it knows the vocabulary): the field named.
    (
        "logit_bias id past the vocabulary",
        "POST",
        C,
        _completion(logit_bias={"99999999": 5}),
        400,
        "logit_bias",
        "outside the vocabulary",
    ),
    (
        "allowed_token_ids past the vocabulary",
        "POST",
        C,
        _completion(allowed_token_ids=[1, 99999999]),
        400,
        "allowed_token_ids",
        "outside the vocabulary",
    ),
    ("stop a number", "POST", C, _completion(stop=3), 400, "stop", "string"),
    ("unknown model", "POST", C, _completion(model="gpt-9"), 404, "model", "does not exist"),
    ("empty prompt list", "POST", C, _completion(prompt=[]), 400, "prompt", "empty"),
    ("token id out of vocab", "POST", C, _completion(prompt=[10**7]), 400, "prompt", "token ids"),
    (
        "prompt over the context",
        "POST", C, _completion(prompt=LONG_PROMPT_IDS), 400, "prompt", f"{MAX_MODEL_LEN} tokens",
    ),
    (
        "prompt + max_tokens over the context",
        "POST", C, _completion(prompt=[5] * 1000, max_tokens=100), 400, "prompt", "1100 tokens",
    ),
    ("missing messages", "POST", CHAT, {"model": "tiny"}, 400, "messages", "required"),
    (
        "message content a number",
        "POST", CHAT, _chat(messages=[{"role": "user", "content": 1}]), 400,
        "messages.0.content", "string",
    ),
    (
        "an image part",
        "POST", CHAT,
        _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400, "messages.0.content", "images and other kinds of part are not read",
    ),
    (
        # A logit_bias key that is also a field's name ("stop") is not taken for that field.
        "logit_bias value not a number",
        "POST", C, _completion(logit_bias={"stop": "x"}), 400, "logit_bias.stop", "number",
    ),
    (
        "top_logprobs without logprobs",
        "POST", CHAT, _chat(top_logprobs=2), 400, "top_logprobs", "logprobs",
    ),
    (
        "negative max_completion_tokens",
        "POST", CHAT, _chat(max_completion_tokens=-3), 400, "max_completion_tokens", ">= 0",
    ),
    ("chat unknown model", "POST", CHAT, _chat(model="nope"), 404, "model", "does not exist"),
    (
        "embedding dimensions above the model's",
        "POST", EMB, {"input": "hi", "dimensions": 65}, 400, "dimensions", "embedding size 64",
    ),
    # Over the context: the hint names the request's field, not truncate=True (Python's).
    (
        "embedding input over the context",
        "POST", EMB, {"input": LONG_PROMPT_IDS}, 400, "input",
        "set the request's truncate_prompt_tokens",
    ),
    (
        "score text over the context",
        "POST", "/v1/score", {"text_1": "a", "text_2": LONG_TEXT}, 400, "text_2",
        "set the request's truncate_prompt_tokens",
    ),
    (
        "rerank document over the context",
        "POST", "/v1/rerank", {"query": "a", "documents": ["b", LONG_TEXT]}, 400, "documents",
        "set the request's truncate_prompt_tokens",
    ),
    # vLLM refuses a truncate_prompt_tokens above max_model_len, however short the prompt.
    (
        "truncate_prompt_tokens above the context",
        "POST", C, _completion(truncate_prompt_tokens=MAX_MODEL_LEN + 1), 400,
        "truncate_prompt_tokens", f"in [1, {MAX_MODEL_LEN}] (max_model_len), got 1025",
    ),
    (
        "chat truncate_prompt_tokens above the context",
        "POST", CHAT, _chat(truncate_prompt_tokens=MAX_MODEL_LEN + 1), 400,
        "truncate_prompt_tokens", f"in [1, {MAX_MODEL_LEN}] (max_model_len), got 1025",
    ),
    ("JSON nested 100,000 deep", "POST", CHAT, NESTED_100K, 400, None, "too deeply"),
    (
        "body over --max-request-body-bytes",
        "POST", C, b'{"prompt": "' + b"a" * MAX_BODY_BYTES + b'"}', 413, None, "larger than",
    ),
    ("n above --max-n", "POST", C, _completion(n=MAX_N + 1), 400, "n", f"at most {MAX_N}"),
    ("n = 5000", "POST", CHAT, _chat(n=5000), 400, "n", f"at most {MAX_N}"),
    (
        "echo alone of a prompt filling the context",
        "POST", C, _completion(prompt=[5] * MAX_MODEL_LEN, max_tokens=0, echo=True), 400,
        "prompt", f"at most {MAX_MODEL_LEN - 1} prompt tokens leave room",
    ),
    (
        "prompts x n above --max-sequences-per-request",
        "POST", C, _completion(prompt=["a"] * 5, n=MAX_N), 400, "prompt",
        f"5 prompt(s) x n={MAX_N} = {5 * MAX_N} sequences; at most {MAX_SEQUENCES}",
    ),
    (
        "100,000 token-id prompts",
        "POST", C, _completion(prompt=[[7]] * 100_000), 400, "prompt",
        f"100000 prompt(s) x n=1 = 100000 sequences; at most {MAX_SEQUENCES}",
    ),
    (
        "unknown role",
        "POST", CHAT, _chat(messages=[{"role": "wizard", "content": "hi"}]), 400,
        "messages.0.role", "'wizard'",
    ),
    (
        "user message without content",
        "POST", CHAT, _chat(messages=[{"role": "user"}]), 400, "messages.0.content", "required",
    ),
    (
        "system message with null content",
        "POST", CHAT, _chat(messages=[{"role": "system", "content": None}]), 400,
        "messages.0.content", "required",
    ),
    (
        "assistant message without content or tool calls",
        "POST", CHAT, _chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant"}]),
        400, "messages.1.content", "required",
    ),
    (
        "tool message without tool_call_id",
        "POST", CHAT, _chat(messages=[{"role": "tool", "content": "4"}]), 400,
        "messages.0.tool_call_id", "required",
    ),
    (
        "structured_outputs.choice a number",
        "POST", C, _completion(structured_outputs={"choice": 5}), 400, "structured_outputs",
        "choice must be a list of strings",
    ),
    (
        "structured_outputs.json text nested 100,000 deep",
        "POST", C, _completion(structured_outputs={"json": NESTED_TEXT}), 400,
        "structured_outputs", "nests JSON",
    ),
    (
        "x-guidance a number",
        "POST", C,
        _completion(response_format={"type": "json_schema", "json_schema": {
            "name": "s", "schema": {"type": "object", "x-guidance": 5}}}),
        400, "response_format", '"x-guidance" must be an object',
    ),
    (
        "earlier tool call's function a string",
        "POST", CHAT, _earlier_call("get_weather"), 400, "messages.1.tool_calls.0.function",
        "must be an object",
    ),
    (
        "earlier tool call's function a number",
        "POST", CHAT, _earlier_call(5), 400, "messages.1.tool_calls.0.function",
        "must be an object",
    ),
    (
        "earlier tool call's arguments nested 100,000 deep",
        "POST", CHAT, _earlier_call({"name": "f", "arguments": NESTED_TEXT}), 400,
        "messages.1.tool_calls.0.function", "arguments nests JSON",
    ),
    (
        "tool_choice.function a string",
        "POST", CHAT,
        _chat(tools=TOOLS, tool_choice={"type": "function", "function": "get_weather"}), 400,
        "tool_choice", "tool_choice.function must be an object",
    ),
    (
        "lone surrogate in a prompt",
        "POST", C, _with_lone_surrogate(b'{"prompt": TEXT, "max_tokens": 2}'), 400, "prompt",
        "prompt is not valid Unicode",
    ),
    (
        "lone surrogate in chat content",
        "POST", CHAT, _with_lone_surrogate(b'{"messages": [{"role": "user", "content": TEXT}]}'),
        400, "messages.0.content", "messages.0.content is not valid Unicode",
    ),
    (
        "lone surrogate in an embedding input",
        "POST", EMB, _with_lone_surrogate(b'{"input": ["fine", TEXT]}'), 400, "input.1",
        "input.1 is not valid Unicode",
    ),
    (
        "lone surrogate in a tokenize prompt",
        "POST", "/tokenize", _with_lone_surrogate(b'{"prompt": TEXT}'), 400, "prompt",
        "prompt is not valid Unicode",
    ),
    ("unknown route", "POST", "/v1/nothing", {}, 404, None, "no route"),
    ("wrong method", "GET", C, None, 405, None, ""),
]  # fmt: skip


def _assert_error(response: httpx.Response, status: int, param: str | None, words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert words in error["message"]
    assert error["type"] == "invalid_request_error"


def _assert_answers(client: httpx.Client) -> None:
    response = client.post(C, json=_completion(temperature=0))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "param", "words"),
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
def test_bad_request_gets_an_openai_error_and_the_server_goes_on(
    client: httpx.Client, method, path, body, status, param, words
) -> None:
    if isinstance(body, bytes):
        response = client.request(method, path, content=body)
    else:
        response = client.request(method, path, json=body)
    _assert_error(response, status, param, words)
    _assert_answers(client)


def test_a_deeply_nested_body_leaves_its_connection_usable(server: ServerProcess) -> None:
    host, port = server.base_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    headers = {**AUTH, "Content-Type": "application/json"}
    try:
        connection.request("POST", CHAT, body=NESTED_100K, headers=headers)
        refused = connection.getresponse()
        assert refused.status == 400 and "too deeply" in refused.read().decode()
        assert refused.getheader("connection", "").lower() != "close"
        first_socket = connection.sock
        connection.request("POST", C, body=json.dumps(_completion()), headers=headers)
        answered = connection.getresponse()
        assert answered.status == 200, answered.read()
        assert json.loads(answered.read())["choices"][0]["text"] is not None
        assert connection.sock is first_socket, "the server closed the connection"
    finally:
        connection.close()


def test_api_key_is_required_on_v1_only(server: ServerProcess, client: httpx.Client) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.post(f"{server.api_url}/completions", json=_completion(), headers=headers)
        _assert_error(response, 401, None, "API key")
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/metrics").status_code == 200
    _assert_answers(client)


async def _stream_text(http: httpx.AsyncClient, prompt: str) -> str:
    body = _completion(prompt=prompt, max_tokens=16, temperature=0, stream=True)
    text = ""
    async with http.stream("POST", C, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def test_64_concurrent_streams_finish_with_correct_outputs(
    server: ServerProcess, client: httpx.Client
) -> None:
    prompts = [f"numbers {i} and {i * 7}" for i in range(64)]
    batch = client.post(C, json=_completion(prompt=prompts, max_tokens=16, temperature=0))
    expected = [choice["text"] for choice in batch.json()["choices"]]

    async def run_all() -> list[str]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(
            base_url=server.base_url, headers=AUTH, timeout=60.0, limits=limits
        ) as http:
            return await asyncio.gather(*(_stream_text(http, p) for p in prompts))

    assert asyncio.run(run_all()) == expected


def test_text_with_unicode_line_breaks_streams_one_event_per_line(client: httpx.Client) -> None:
    # Line breaks to str.splitlines(), and so to httpx's iter_lines, which SSE clients often
    # read streams with; JSON may carry them raw (they are not JSON's control characters).
    prompt = "one\x85two\u2028three\u2029four"
    body = _completion(prompt=prompt, echo=True, max_tokens=1, stream=True)
    with client.stream("POST", C, json=body) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines), lines
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["text"].startswith(prompt)


def _metrics(client: httpx.Client) -> str:
    return client.get("/metrics").text


def test_a_client_that_leaves_mid_stream_frees_its_pages(client: httpx.Client) -> None:
    aborted_before = metric_value(_metrics(client), "vacpack:request_aborted_total")
    # Long enough (4 x 1000 tokens) that it is still running when the client leaves.
    body = _completion(max_tokens=1000, n=4, stream=True, ignore_eos=True)
    with client.stream("POST", C, json=body) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert metric_value(_metrics(client), "vacpack:kv_cache_used_pages") > 0
    # Leaving the `with` closed the connection mid-stream.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        metrics = _metrics(client)
        if metric_value(metrics, "vacpack:request_aborted_total") > aborted_before:
            break
        time.sleep(0.05)
    assert metric_value(metrics, "vacpack:request_aborted_total") == aborted_before + 1
    assert metric_value(metrics, "vacpack:kv_cache_used_pages") == 0
    assert metric_value(metrics, "vacpack:num_requests_running") == 0
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        assert metric_value(metrics, f"vacpack:{name}_count") > 0
    assert metric_value(metrics, "vacpack:generation_tokens_total") > 0
    _assert_answers(client)


def _connect(server: ServerProcess) -> socket.socket:
    host, port = server.base_url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _raw_post(path: str, body: bytes, content_length: int) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: test\r\nAuthorization: {AUTH['Authorization']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {content_length}\r\n\r\n"
    )
    return head.encode() + body


def test_a_client_that_leaves_while_sending_its_body_is_no_server_error(
    server: ServerProcess, client: httpx.Client
) -> None:
    log_before = len(server.log())
    body = json.dumps(_completion()).encode()
    for path in (C, CHAT, EMB):
        with _connect(server) as connection:
            connection.sendall(_raw_post(path, body[:10], len(body)))
    _assert_answers(client)  # by now the server has seen each connection close
    new_log = server.log()[log_before:]
    assert "Traceback" not in new_log and "unexpected error" not in new_log, new_log


def _num_finished(metrics: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("vacpack:request_success_total{")
    )


async def _leave_mid_stream(http: httpx.AsyncClient, path: str, body: dict, after: int) -> None:
    async with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        num_events = 0
        async for line in response.aiter_lines():
            num_events += line.startswith("data: ")
            if num_events == after:
                return  # leaving the `with` closes the connection
    raise AssertionError("the stream ended before the client left")


async def _give_up_waiting(http: httpx.AsyncClient, path: str, body: dict, after_s: float) -> None:
    with pytest.raises(httpx.TimeoutException):
        await http.post(path, json=body, timeout=after_s)


def _leave_right_after_sending(server: ServerProcess, path: str, body: dict) -> None:
    data = json.dumps(body).encode()
    with _connect(server) as connection:
        connection.sendall(_raw_post(path, data, len(data)))


def test_clients_that_leave_together_in_every_way_free_every_page(
    server: ServerProcess, client: httpx.Client
) -> None:
    # Each would run for minutes: only aborts can end them within the test.
    completion = _completion(max_tokens=1000, ignore_eos=True, n=2)
    chat = _chat(max_tokens=1000, ignore_eos=True, n=2, logprobs=True)
    finished_before = _num_finished(_metrics(client))

    async def leave_in_every_way() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=30.0) as http:
            await asyncio.gather(
                *(_leave_mid_stream(http, C, completion, after=1 + i % 4) for i in range(8)),
                *(_leave_mid_stream(http, CHAT, chat, after=1 + i % 4) for i in range(8)),
                *(_give_up_waiting(http, C, completion, 0.2 + 0.1 * i) for i in range(4)),
                *(_give_up_waiting(http, CHAT, chat, 0.2 + 0.1 * i) for i in range(4)),
                *(
                    asyncio.to_thread(_leave_right_after_sending, server, path, body)
                    for path, body in [(C, completion), (CHAT, chat)] * 4
                ),
            )

    asyncio.run(leave_in_every_way())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        metrics = _metrics(client)
        busy = ("kv_cache_used_pages", "num_requests_running", "num_requests_waiting")
        if not any(metric_value(metrics, f"vacpack:{name}") for name in busy):
            break
        time.sleep(0.05)
    for name in busy:
        assert metric_value(metrics, f"vacpack:{name}") == 0, name
    assert _num_finished(metrics) == finished_before  # aborted, every one, not run to the end
    _assert_answers(client)


@pytest.fixture
def one_slot_server(tiny_checkpoint) -> Iterator[ServerProcess]:
    """One running sequence at most, one waiting: the third request finds the queue full."""
    with running_server(
        tiny_checkpoint("qwen2"),
        "--max-model-len", "1024",
        "--kv-cache-memory-bytes", str(4 << 20),
        "--max-num-seqs", "1",
        "--max-waiting-requests", "1",
        "--shutdown-timeout-s", "20",
    ) as process:  # fmt: skip
        yield process


def test_full_queue_gets_503_and_sigterm_lets_streams_finish(
    one_slot_server: ServerProcess,
) -> None:
    long_body = _completion(
        model=None, max_tokens=500, ignore_eos=True, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    with (
        httpx.Client(base_url=one_slot_server.base_url, timeout=60.0) as http,
        http.stream("POST", C, json=long_body) as running,
    ):
        running_lines = running.iter_lines()
        assert next(line for line in running_lines if line.startswith("data: "))
        with http.stream("POST", C, json=long_body) as waiting:
            assert waiting.status_code == 200  # taken, waiting for the slot
            refused = http.post(C, json=_completion(model=None))
            assert refused.status_code == 503
            assert refused.headers["Retry-After"] == "1"
            assert refused.json()["error"]["code"] == "server_overloaded"

            # SIGTERM: no new connections, but the two streams in flight run to the end.
            one_slot_server.process.send_signal(signal.SIGTERM)
            _assert_refuses_connections_while_draining(one_slot_server)
            for lines in (running_lines, waiting.iter_lines()):
                events = [line[6:] for line in lines if line.startswith("data: ")]
                assert events[-1] == "[DONE]"
                assert json.loads(events[-3])["choices"][0]["finish_reason"] == "length"
                assert json.loads(events[-2])["usage"]["completion_tokens"] == 500
    # Well within --shutdown-timeout-s: the drain ended when the streams did.
    assert one_slot_server.process.wait(timeout=20) == 0


@pytest.fixture
def short_drain_server(tiny_checkpoint) -> Iterator[ServerProcess]:
    with running_server(
        tiny_checkpoint("qwen2"),
        "--max-model-len", "1024",
        "--kv-cache-memory-bytes", str(8 << 20),
        "--shutdown-timeout-s", "0.5",
    ) as process:  # fmt: skip
        yield process


def test_requests_still_running_when_the_drain_time_is_up_end_with_a_503(
    short_drain_server: ServerProcess,
) -> None:
    # Far longer than the half second SIGTERM leaves them.
    long_body = _completion(model=None, max_tokens=1000, ignore_eos=True, n=4)
    with (
        httpx.Client(base_url=short_drain_server.base_url, timeout=30.0) as http,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
        http.stream("POST", C, json={**long_body, "stream": True}) as streamed,
    ):
        lines = streamed.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        whole = pool.submit(http.post, C, json=long_body)
        deadline = time.monotonic() + 10
        while metric_value(_metrics(http), "vacpack:num_requests_running") < 8:
            assert time.monotonic() < deadline, "the second request never started"
            time.sleep(0.02)
        short_drain_server.process.send_signal(signal.SIGTERM)

        events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "shutdown"
        refused = whole.result()
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "shutdown"
    assert short_drain_server.process.wait(timeout=10) == 0


def _assert_refuses_connections_while_draining(server: ServerProcess) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{server.base_url}/health", timeout=1.0)
        # Refused, or (a connection the kernel had queued just before the listener closed)
        # closed unanswered: either way no new request is served.
        except (httpx.ConnectError, httpx.RemoteProtocolError):
            assert server.process.poll() is None, "the server exited instead of draining"
            return
        time.sleep(0.05)
    raise AssertionError("the server still took new connections 5 s after SIGTERM")
