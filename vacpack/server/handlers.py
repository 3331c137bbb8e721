"""The OpenAI endpoints: parse, hand to the engine thread, answer (whole, or as a stream).

Every engine request a client started is aborted when the client goes away before it finishes:
a streaming response is cancelled by Starlette on disconnect, and a non-streaming one races its
work against a disconnect watcher.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from transformers import PreTrainedTokenizerBase

from vacpack.lora.request import LoRARequest
from vacpack.openai_api.errors import APIError, bad_request, internal_error
from vacpack.openai_api.logprobs import DecodeToken
from vacpack.openai_api.pooling import (
    PreparedPooling,
    prepare_classify,
    prepare_embeddings,
    prepare_encode,
    prepare_rerank,
    prepare_score,
)
from vacpack.openai_api.protocol import (
    ClassificationRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    EncodeRequest,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
    json_object,
    parse_body,
)
from vacpack.openai_api.requests import (
    RESPONSE_ID_PREFIXES,
    GenerationKind,
    PreparedGeneration,
    parse_generation,
    prepare_generation,
)
from vacpack.openai_api.responses import (
    PromptResult,
    generation_body,
    new_response_id,
    now_s,
)
from vacpack.openai_api.served_model import (
    check_model,
    check_n,
    check_num_sequences,
    check_pooling_model,
)
from vacpack.openai_api.serving import PoolingFunctions
from vacpack.openai_api.streaming import StreamState
from vacpack.openai_api.tokenization import detokenize_body, tokenize_body
from vacpack.outputs import RequestOutput, RequestOutputKind
from vacpack.server.async_engine import AsyncEngine
from vacpack.server.beam_search import beam_search_outputs
from vacpack.server.lora_updates import ServedAdapters
from vacpack.server.options import ServerConfig
from vacpack.server.request_stream import EngineRequest, RequestStream

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ClientDisconnected(Exception):
    pass


def json_response(body: dict[str, Any], status_code: int = 200, **kwargs: Any) -> Response:
    # ensure_ascii=False: text stays as the model wrote it, and smaller on the wire.
    content = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    return Response(content, status_code, media_type="application/json", **kwargs)


# Line breaks to str.splitlines() (and so to httpx's iter_lines, which many SSE clients read
# streams with) that JSON leaves raw in a string: escaped, a generated one cannot split an event
# in two for such a client. The JSON value is the same.
_RAW_JSON_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _sse(data: dict[str, Any]) -> str:
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    if not text.isascii():
        text = text.translate(_RAW_JSON_LINE_BREAKS)
    return f"data: {text}\n\n"


_SSE_DONE = "data: [DONE]\n\n"


@dataclass(frozen=True)
class OpenAIHandlers:
    config: ServerConfig
    engine: AsyncEngine
    tokenizer: PreTrainedTokenizerBase
    max_model_len: int
    pooling: PoolingFunctions
    # The model's recommended sampling, for fields a request leaves out (generation_defaults).
    sampling_defaults: Mapping[str, Any]
    eos_token_ids: frozenset[int] = frozenset()  # ending a beam search's hypotheses
    scheduling_policy: str = "fcfs"  # the engine's (EngineConfig.scheduling_policy)

    # ------------------------------------------------------------ small endpoints
    def models(self, created: int) -> Response:
        cards = [self._model_card(created, None)]
        cards += [self._model_card(created, adapter) for adapter in self._adapters.values()]
        return json_response({"object": "list", "data": cards})

    def model(self, model_id: str, created: int) -> Response:
        """The served model's (or adapter's) card, or 404 model_not_found for any other id."""
        return json_response(self._model_card(created, self._check_model(model_id)))

    def _model_card(self, created: int, adapter: LoRARequest | None) -> dict[str, Any]:
        base = self.config.served_model_name
        card = {
            "id": base if adapter is None else adapter.lora_name,
            "object": "model",
            "created": created,
            "owned_by": "vacpack",
            "max_model_len": self.max_model_len,
        }
        if adapter is not None:  # as vLLM lists a LoRA module: its base model and its files
            card |= {"parent": base, "root": adapter.lora_path}
        return card

    @functools.cached_property
    def served_adapters(self) -> ServedAdapters:
        return ServedAdapters(self.config.served_model_name, self.config.lora_requests)

    @property
    def _adapters(self) -> dict[str, LoRARequest]:
        return self.served_adapters.by_name

    async def load_lora_adapter(self, raw: Request) -> Response:
        message = await self.served_adapters.load(self.engine, await raw.body())
        return Response(message, media_type="text/plain")

    async def unload_lora_adapter(self, raw: Request) -> Response:
        message = await self.served_adapters.unload(self.engine, await raw.body())
        return Response(message, media_type="text/plain")

    def _check_model(self, model: str | None) -> LoRARequest | None:
        return check_model(model, self.config.served_model_name, self._adapters)

    def _check_pooling_model(self, model: str | None) -> None:
        check_pooling_model(model, self.config.served_model_name, self._adapters)

    def _check_n(self, n: int | None) -> None:
        check_n(n, self.config.max_n)

    def _require_generation(self) -> None:
        if not self.engine.serves_generation:
            raise bad_request("this model does not generate text: it has no LM head", "model")

    @functools.cached_property
    def _decode_token(self) -> DecodeToken:
        return DecodeToken(self.tokenizer)

    # ------------------------------------------------------------ generation
    # Parsing, the chat template and tokenizing run on a worker thread: a huge prompt must not
    # hold up the event loop, and with it every other client.
    async def completions(self, raw: Request) -> Response:
        return await self._generation(raw, "completion")

    async def chat_completions(self, raw: Request) -> Response:
        return await self._generation(raw, "chat")

    async def invocations(self, raw: Request) -> Response:
        """SageMaker's one route: chat for `messages`, completions for `prompt`, embeddings
        (classify, for a classifier) for `input`."""
        fields = json_object(await raw.body())
        if "messages" in fields:
            return await self.chat_completions(raw)
        if "prompt" in fields:
            return await self.completions(raw)
        if "input" in fields:
            if self.pooling.embed is None and self.pooling.classify is not None:
                return await self.classify(raw)
            return await self.embeddings(raw)
        raise bad_request(
            "an /invocations body names messages (chat), prompt (completions) or input "
            "(embeddings, or classify for a classifier)"
        )

    async def _generation(self, raw: Request, kind: GenerationKind) -> Response:
        prepared = await asyncio.to_thread(self._prepare, kind, await raw.body())
        return await self._generate(raw, prepared, new_response_id(RESPONSE_ID_PREFIXES[kind]))

    def _prepare(self, kind: GenerationKind, body: bytes) -> PreparedGeneration:
        request = parse_generation(kind, body)
        adapter = self._check_model(request.model)
        self._check_n(request.n)
        check_num_sequences(request.num_prompts, request.n, self.config.max_sequences_per_request)
        self._require_generation()
        output_kind = RequestOutputKind.DELTA
        prepared = prepare_generation(
            request,
            self.tokenizer,
            self.max_model_len,
            output_kind,
            tool_call_parser=self.config.tool_call_parser,
            sampling_defaults=self.sampling_defaults,
            scheduling_policy=self.scheduling_policy,
        )
        return dataclasses.replace(prepared, lora_request=adapter)

    async def _generate(
        self, raw: Request, prepared: PreparedGeneration, response_id: str
    ) -> Response:
        n = prepared.num_choices_per_prompt
        state = StreamState(
            response_id=response_id,
            created=now_s(),
            # The name the client asked for: the adapter's, where it named one (as vLLM answers).
            model_name=prepared.lora_request.lora_name
            if prepared.lora_request is not None
            else self.config.served_model_name,
            prepared=prepared,
            results=[PromptResult.start(prompt, n) for prompt in prepared.prompts],
            decode_token=self._decode_token,
        )
        outputs = await self._outputs(raw, prepared, response_id)
        if prepared.stream:
            return StreamingResponse(
                self._stream_events(outputs, state),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        try:
            await _unless_disconnected(self._collect(outputs, state), raw)
        finally:
            await outputs.aclose()
        body = generation_body(
            response_id,
            state.created,
            state.model_name,
            prepared,
            state.results,
            self._decode_token,
        )
        return json_response(body)

    async def _outputs(
        self, raw: Request, prepared: PreparedGeneration, response_id: str
    ) -> AsyncGenerator[RequestOutput, None]:
        """The engine's outputs for the request, prompt i's under `{response_id}-{i}`; closing
        the generator aborts what is still running."""
        if prepared.beam_search is not None:
            return beam_search_outputs(
                self.engine,
                prepared,
                response_id,
                self.eos_token_ids,
                self.max_model_len,
                self.tokenizer,
            )
        engine_requests = [
            EngineRequest(
                f"{response_id}-{index}",
                prompt.token_ids,
                prepared.params,
                prompt.text,
                prepared.lora_request,
                prepared.priority,
            )
            for index, prompt in enumerate(prepared.prompts)
        ]
        stream = await _unless_disconnected(self.engine.submit(engine_requests), raw)
        return _stream_outputs(self.engine, stream)

    @staticmethod
    async def _collect(outputs: AsyncIterator[RequestOutput], state: StreamState) -> None:
        async for output in outputs:
            state.results[_prompt_index(output)].add_delta(output)

    async def _stream_events(
        self, outputs: AsyncGenerator[RequestOutput, None], state: StreamState
    ) -> AsyncIterator[str]:
        is_chat = state.prepared.kind == "chat"
        try:
            if is_chat:
                yield "".join(_sse(chunk) for chunk in state.chat_role_chunks())
            async for output in outputs:
                chunks = (
                    state.chat_chunks(output)
                    if is_chat
                    else state.completion_chunks(_prompt_index(output), output)
                )
                events = "".join(_sse(chunk) for chunk in chunks)
                if events:
                    yield events
            usage = state.usage_chunk()
            yield (_sse(usage) if usage else "") + _SSE_DONE
        except APIError as error:
            # The status line has gone out already: the error travels as a last event.
            yield _sse(error.to_body()) + _SSE_DONE
        except Exception as error:
            # A bug this output hit: the client still gets an error event and the end of the
            # stream, not a connection cut mid-body.
            logger.exception("a streamed response failed")
            yield _sse(internal_error(error).to_body()) + _SSE_DONE
        finally:
            # Reached on normal end, on an error, and when Starlette cancels us on disconnect.
            await outputs.aclose()

    # ------------------------------------------------------------ embeddings and scores
    async def embeddings(self, raw: Request) -> Response:
        return await self._pool(raw, self._prepare_embeddings)

    async def score(self, raw: Request) -> Response:
        return await self._pool(raw, self._prepare_score)

    async def rerank(self, raw: Request) -> Response:
        return await self._pool(raw, self._prepare_rerank)

    async def classify(self, raw: Request) -> Response:
        return await self._pool(raw, self._prepare_classify)

    async def encode(self, raw: Request) -> Response:
        return await self._pool(raw, self._prepare_encode)

    async def _pool(self, raw: Request, prepare: Callable[[bytes], PreparedPooling]) -> Response:
        prepared = await asyncio.to_thread(prepare, await raw.body())
        return json_response(await _unless_disconnected(self.engine.pool(prepared), raw))

    def _prepare_embeddings(self, body: bytes) -> PreparedPooling:
        request = parse_body(EmbeddingRequest, body)
        self._check_pooling_model(request.model)
        return prepare_embeddings(request, self.pooling, self.config.served_model_name)

    def _prepare_score(self, body: bytes) -> PreparedPooling:
        request = parse_body(ScoreRequest, body)
        self._check_pooling_model(request.model)
        name = self.config.served_model_name
        return prepare_score(request, self.pooling, name, new_response_id("score"))

    def _prepare_rerank(self, body: bytes) -> PreparedPooling:
        request = parse_body(RerankRequest, body)
        self._check_pooling_model(request.model)
        name = self.config.served_model_name
        return prepare_rerank(request, self.pooling, name, new_response_id("rerank"))

    def _prepare_classify(self, body: bytes) -> PreparedPooling:
        request = parse_body(ClassificationRequest, body)
        self._check_pooling_model(request.model)
        name = self.config.served_model_name
        return prepare_classify(request, self.pooling, name, new_response_id("classify"))

    def _prepare_encode(self, body: bytes) -> PreparedPooling:
        request = parse_body(EncodeRequest, body)
        self._check_pooling_model(request.model)
        name = self.config.served_model_name
        return prepare_encode(request, self.pooling, name, new_response_id("pool"))

    # ------------------------------------------------------------ tokenizer
    async def tokenize(self, raw: Request) -> Response:
        return json_response(await asyncio.to_thread(self._tokenize, await raw.body()))

    async def detokenize(self, raw: Request) -> Response:
        return json_response(await asyncio.to_thread(self._detokenize, await raw.body()))

    def _tokenize(self, body: bytes) -> dict[str, Any]:
        request = parse_body(TokenizeRequest, body)
        self._check_model(request.model)
        return tokenize_body(
            request, self.tokenizer, self.max_model_len, self.config.tool_call_parser
        )

    def _detokenize(self, body: bytes) -> dict[str, Any]:
        request = parse_body(DetokenizeRequest, body)
        self._check_model(request.model)
        return detokenize_body(request, self.tokenizer)


def _prompt_index(output: RequestOutput) -> int:
    """The prompt an output belongs to: its request id ends in the prompt's index."""
    return int(output.request_id.rpartition("-")[2])


async def _stream_outputs(
    engine: AsyncEngine, stream: RequestStream
) -> AsyncGenerator[RequestOutput, None]:
    try:
        async for output in stream:
            yield output
    finally:
        if not stream.finished:
            engine.abort(stream.request_ids)


async def _unless_disconnected(work: Awaitable[T], raw: Request) -> T:
    """The work's result, or ClientDisconnected (with the work cancelled) if the client left."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()
    if not work_task.done() or work_task.cancelled():
        raise ClientDisconnected()
    return work_task.result()


async def _wait_for_disconnect(raw: Request) -> None:
    # The body has been read, so the next ASGI message for this request is the disconnect.
    while (await raw.receive())["type"] != "http.disconnect":
        pass
