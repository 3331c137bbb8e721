"""Embedding, score, rerank, classify and pooling requests: checked, run in packed jobs,
answered in vLLM's shapes.

The server and batch files both prepare a request here (every 400 a request can earn before it
runs), then run many prepared requests at once with `run_pooling`: requests that can share a
job (same kind and options) run as one packed corpus job, and each gets its own response body,
or its own 400 when one of its inputs is bad.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from vacpack.corpus.encode import check_dimensions_apply, check_pooling_task
from vacpack.corpus.scoring import TextPair, pair_inputs
from vacpack.corpus.tasks import TRUNCATE_HINT
from vacpack.openai_api.errors import APIError, bad_request
from vacpack.openai_api.protocol import (
    SCORE_FIELD_PAIRS,
    ClassificationRequest,
    EmbeddingRequest,
    EncodeRequest,
    RerankRequest,
    ScoreRequest,
)
from vacpack.openai_api.requests import prepare_embedding
from vacpack.openai_api.responses import base64_float32, embedding_body, now_s
from vacpack.openai_api.serving import PoolingFunctions, run_grouped
from vacpack.outputs import ClassificationRequestOutput, PoolingRequestOutput, ScoringRequestOutput
from vacpack.pooling_params import PoolingParams

# How a request asks for over-long inputs to be cut. The jobs' errors name the Python and
# command-line knob (tasks.TRUNCATE_HINT: truncate=True, --truncate), which an HTTP or batch-file
# client does not have: its 400 names the request's field instead.
REQUEST_TRUNCATE_HINT = (
    "set the request's truncate_prompt_tokens (-1 keeps as many tokens as the context holds)"
)


@dataclass(frozen=True)
class PreparedPooling:
    """A request ready to run: its inputs, which job it may share, how to answer it."""

    # ("embed", dimensions, k), ("score", use_activation, k), ("classify", None, k) or
    # ("pool", (task, PoolingParams), k), k the request's truncate_prompt_tokens: requests
    # with equal keys share a job.
    job_key: tuple[str, Any, int | None]
    inputs: list[Any]  # texts or token ids to embed, or (text_1, text_2) pairs
    finish: Callable[[list[Any]], dict[str, Any]]  # the job's outputs -> the response body
    error_param: str | None  # the request field a failed input is reported under


def prepare_embeddings(
    request: EmbeddingRequest, functions: PoolingFunctions, model_name: str
) -> PreparedPooling:
    if functions.embed is None:
        raise bad_request(functions.no_embed_reason, "model")
    if request.dimensions is not None:
        try:
            functions.check_dimensions(request.dimensions)
        except ValueError as error:
            raise bad_request(str(error), "dimensions") from None
    encoding_format = request.encoding_format or "float"
    truncation = _checked_truncation(request.truncate_prompt_tokens, functions, "embed")
    return PreparedPooling(
        job_key=("embed", request.dimensions, truncation),
        inputs=prepare_embedding(request),
        finish=partial(_embeddings_finish, model_name, encoding_format),
        error_param="input",
    )


def prepare_classify(
    request: ClassificationRequest, functions: PoolingFunctions, model_name: str, response_id: str
) -> PreparedPooling:
    if functions.classify is None:
        raise bad_request(functions.no_classify_reason, "model")
    truncation = _checked_truncation(request.truncate_prompt_tokens, functions, "classify")
    return PreparedPooling(
        job_key=("classify", None, truncation),
        inputs=prepare_embedding(request),
        finish=partial(classification_body, response_id, model_name, now_s()),
        error_param="input",
    )


def prepare_encode(
    request: EncodeRequest, functions: PoolingFunctions, model_name: str, response_id: str
) -> PreparedPooling:
    task = request.task or functions.default_pooling_task
    try:
        check_pooling_task(task, "task")
    except ValueError as error:
        raise bad_request(str(error), "task") from None
    if task == "classify" and functions.classify is None:
        raise bad_request(functions.no_classify_reason, "task")
    if task != "classify" and functions.embed is None:
        raise bad_request(functions.no_embed_reason, "task")
    if request.dimensions is not None:
        try:
            check_dimensions_apply(task, request.dimensions)
            functions.check_dimensions(request.dimensions)
        except ValueError as error:
            raise bad_request(str(error), "dimensions") from None
    kind = "classify" if task == "classify" else "embed"
    truncation = _checked_truncation(request.truncate_prompt_tokens, functions, kind)
    params = PoolingParams(request.use_activation, request.dimensions)
    return PreparedPooling(
        job_key=("pool", (task, params), truncation),
        inputs=prepare_embedding(request),
        finish=partial(
            pooling_body, response_id, model_name, now_s(), request.encoding_format or "float"
        ),
        error_param="input",
    )


def prepare_score(
    request: ScoreRequest, functions: PoolingFunctions, model_name: str, response_id: str
) -> PreparedPooling:
    if functions.score is None:
        raise bad_request(functions.no_score_reason, "model")
    given = [(a, b) for a, b in SCORE_FIELD_PAIRS if getattr(request, a) is not None]
    given = [(a, b) for a, b in given if getattr(request, b) is not None]
    if len(given) != 1:
        names = " or ".join(f"{a} and {b}" for a, b in SCORE_FIELD_PAIRS)
        raise bad_request(f"give exactly one pair of inputs: {names}", SCORE_FIELD_PAIRS[0][1])
    first, second = given[0]
    pairs = _pairs(getattr(request, first), getattr(request, second), first, second)
    truncation = _checked_truncation(request.truncate_prompt_tokens, functions, "score")
    return PreparedPooling(
        job_key=("score", request.use_activation is not False, truncation),
        inputs=pairs,
        finish=partial(score_body, response_id, model_name, now_s()),
        error_param=second,
    )


def prepare_rerank(
    request: RerankRequest, functions: PoolingFunctions, model_name: str, response_id: str
) -> PreparedPooling:
    if functions.score is None:
        raise bad_request(functions.no_score_reason, "model")
    if request.top_n is not None and request.top_n < 0:
        raise bad_request(f"top_n must be >= 0, got {request.top_n}", "top_n")
    pairs = _pairs(request.query, request.documents, "query", "documents")
    truncation = _checked_truncation(request.truncate_prompt_tokens, functions, "score")
    return PreparedPooling(
        job_key=("score", request.use_activation is not False, truncation),
        inputs=pairs,
        finish=partial(
            rerank_body,
            response_id,
            model_name,
            request.documents if request.return_documents is not False else None,
            request.top_n,
        ),
        error_param="documents",
    )


def run_pooling(
    functions: PoolingFunctions, prepared: Sequence[PreparedPooling]
) -> list[dict[str, Any] | APIError]:
    """Each request's response body, or its 400; requests sharing a job key run as one job."""
    by_key: dict[tuple[str, Any, int | None], list[int]] = defaultdict(list)
    for index, request in enumerate(prepared):
        by_key[request.job_key].append(index)
    results: dict[int, dict[str, Any] | APIError] = {}
    for key, indices in by_key.items():
        job = _job_function(functions, key)
        outputs = run_grouped(job, [prepared[index].inputs for index in indices])
        for index, output in zip(indices, outputs, strict=True):
            request = prepared[index]
            if isinstance(output, ValueError):
                results[index] = bad_request(_for_request(str(output)), request.error_param)
            else:
                results[index] = request.finish(output)
    return [results[index] for index in range(len(prepared))]


def run_pooling_apart_on_failure(
    functions: PoolingFunctions,
    prepared: Sequence[PreparedPooling],
    failure: Callable[[int, Exception], APIError],
) -> list[dict[str, Any] | APIError]:
    """run_pooling, but where the packed jobs raise (not a bad input, which is a 400: a bug or
    a device fault), each request runs again alone, so that only a request that fails alone
    gets `failure(its index, the error)` and the others their answers."""
    try:
        return run_pooling(functions, prepared)
    except Exception as error:
        if len(prepared) == 1:
            return [failure(0, error)]
    results: list[dict[str, Any] | APIError] = []
    for index, request in enumerate(prepared):
        try:
            results.extend(run_pooling(functions, [request]))
        except Exception as error:
            results.append(failure(index, error))
    return results


def score_body(
    response_id: str, model_name: str, created: int, outputs: Sequence[ScoringRequestOutput]
) -> dict[str, Any]:
    data = [
        {"index": index, "object": "score", "score": output.outputs.score}
        for index, output in enumerate(outputs)
    ]
    return _list_body(response_id, model_name, created, data, outputs)


def classification_body(
    response_id: str,
    model_name: str,
    created: int,
    outputs: Sequence[ClassificationRequestOutput],
) -> dict[str, Any]:
    data = [
        {
            "index": index,
            "label": output.outputs.label,
            "probs": list(output.outputs.probs),
            "num_classes": len(output.outputs.probs),
        }
        for index, output in enumerate(outputs)
    ]
    return _list_body(response_id, model_name, created, data, outputs)


def pooling_body(
    response_id: str,
    model_name: str,
    created: int,
    encoding_format: str,
    outputs: Sequence[PoolingRequestOutput],
) -> dict[str, Any]:
    """vLLM's /pooling answer: each input's tensor as nested lists, or with "base64" its
    float32 values, flattened, little-endian."""
    data = [
        {
            "index": index,
            "object": "pooling",
            "data": base64_float32(output.outputs.data.flatten().tolist())
            if encoding_format == "base64"
            else output.outputs.data.tolist(),
        }
        for index, output in enumerate(outputs)
    ]
    return _list_body(response_id, model_name, created, data, outputs)


def _list_body(
    response_id: str,
    model_name: str,
    created: int,
    data: list[dict[str, Any]],
    outputs: Sequence[PoolingRequestOutput],
) -> dict[str, Any]:
    """vLLM's list response of one entry per input, with the prompt tokens the inputs took."""
    num_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return {
        "id": response_id,
        "object": "list",
        "created": created,
        "model": model_name,
        "data": data,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0},
    }


def rerank_body(
    response_id: str,
    model_name: str,
    documents: Sequence[str] | None,
    top_n: int | None,
    outputs: Sequence[ScoringRequestOutput],
) -> dict[str, Any]:
    """Documents by relevance, most relevant first; the top_n of them when top_n > 0. Each
    result carries its document's text, as vLLM's do, unless `documents` is None (the client
    sent return_documents: false)."""
    ranked = sorted(range(len(outputs)), key=lambda index: -outputs[index].outputs.score)
    if top_n:
        ranked = ranked[:top_n]
    num_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return {
        "id": response_id,
        "model": model_name,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        "results": [
            {
                "index": index,
                **({"document": {"text": documents[index]}} if documents is not None else {}),
                "relevance_score": outputs[index].outputs.score,
            }
            for index in ranked
        ],
    }


def _job_function(
    functions: PoolingFunctions, key: tuple[str, Any, int | None]
) -> Callable[[list[Any]], list[Any]]:
    kind, option, truncate_prompt_tokens = key
    classify, embed, score = functions.classify, functions.embed, functions.score
    if kind == "pool":
        task, params = option
        return lambda inputs: functions.encode(inputs, task, params, truncate_prompt_tokens)
    if kind == "classify":
        assert classify is not None, "prepare_classify refuses it"
        return lambda inputs: classify(inputs, truncate_prompt_tokens)
    if kind == "embed":
        assert embed is not None, "prepare_embeddings refuses it"
        return lambda inputs: embed(inputs, option, truncate_prompt_tokens)
    assert score is not None, "prepare_score and prepare_rerank refuse it"
    return lambda pairs: score(pairs, option, truncate_prompt_tokens)


def _checked_truncation(
    truncate_prompt_tokens: int | None, functions: PoolingFunctions, kind: str
) -> int | None:
    """The request's truncate_prompt_tokens, or a 400 naming the field and its limits."""
    if truncate_prompt_tokens is not None:
        try:
            functions.check_truncation(kind, truncate_prompt_tokens)
        except ValueError as error:
            raise bad_request(str(error), "truncate_prompt_tokens") from None
    return truncate_prompt_tokens


def _for_request(job_message: str) -> str:
    """A job's error message as a request's 400 says it: naming the request's knobs."""
    return job_message.replace(TRUNCATE_HINT, REQUEST_TRUNCATE_HINT)


def _pairs(
    first: str | list[str], second: str | list[str], first_name: str, second_name: str
) -> list[TextPair]:
    try:
        return pair_inputs(first, second, (first_name, second_name))
    except ValueError as error:
        raise bad_request(str(error), second_name) from None


def _embeddings_finish(model_name: str, encoding_format: str, outputs: list[Any]) -> dict[str, Any]:
    return embedding_body(model_name, outputs, encoding_format)
