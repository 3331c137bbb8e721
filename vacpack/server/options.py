"""Server options: a frozen config, and the `vacpack serve` flags that fill it."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from vacpack.lora.modules import add_lora_modules_arg, lora_requests
from vacpack.lora.request import LoRARequest
from vacpack.openai_api.served_model import DEFAULT_MAX_N, DEFAULT_MAX_SEQUENCES_PER_REQUEST
from vacpack.openai_api.tool_parsers import TOOL_CALL_PARSERS

API_KEY_ENV = "VACPACK_API_KEY"


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    # Sequences waiting for a slot beyond which new requests get 503 + Retry-After.
    max_waiting_requests: int | None = None
    retry_after_s: int = 1
    # On SIGTERM: how long in-flight requests may run before they are ended with a 503.
    shutdown_timeout_s: float = 30.0
    log_level: str = "info"
    # How tool calls are read from outputs: "auto" (from the chat template) or a parser's name.
    tool_call_parser: str = "auto"
    # The most choices (n) one request may ask for (served_model.DEFAULT_MAX_N says why).
    max_n: int = DEFAULT_MAX_N
    # The most sequences (prompts x n) one request may start (served_model says why).
    max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST
    # A larger request body gets 413, refused by its Content-Length before it is read.
    max_request_body_bytes: int = 32 << 20
    # LoRA adapters served beside the base model: (name, path), a request's `model` picks one.
    lora_modules: tuple[tuple[str, str], ...] = ()
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's, behind its
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING): off by default, as they change what the server runs.
    allow_runtime_lora_updating: bool = False

    def __post_init__(self) -> None:
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")
        if self.max_sequences_per_request < 1:
            raise ValueError(
                f"max_sequences_per_request must be >= 1, got {self.max_sequences_per_request}"
            )
        if self.max_request_body_bytes < 1:
            raise ValueError(
                f"max_request_body_bytes must be >= 1, got {self.max_request_body_bytes}"
            )
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                f"got {self.tool_call_parser!r}"
            )
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError(
                f"max_waiting_requests must be >= 1 or None, got {self.max_waiting_requests}"
            )
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")
        lora_requests(self.lora_modules, self.served_model_name)  # the names are checked

    @property
    def lora_requests(self) -> dict[str, LoRARequest]:
        """The served adapters by name, with ids 1, 2, ... in the order given."""
        return lora_requests(self.lora_modules, self.served_model_name)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument(
        "--api-key", default=None, help=f"require this bearer token (default: ${API_KEY_ENV})"
    )
    group.add_argument(
        "--served-model-name", default=None, help="the model name clients use (default: --model)"
    )
    group.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="answer 503 while this many sequences wait for a slot (default: no limit)",
    )
    group.add_argument("--shutdown-timeout-s", type=float, default=30.0)
    group.add_argument("--log-level", default="info")
    group.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default="auto",
        help="the tool-call format: hermes (<tool_call>, Qwen), llama3_json, mistral "
        "([TOOL_CALLS]), pythonic ([f(a=1)], Llama 3.2 / 4), or auto (from the chat template)",
    )
    group.add_argument(
        "--max-n",
        type=int,
        default=DEFAULT_MAX_N,
        help=f"most choices (n) one request may ask for (default {DEFAULT_MAX_N})",
    )
    group.add_argument(
        "--max-sequences-per-request",
        type=int,
        default=DEFAULT_MAX_SEQUENCES_PER_REQUEST,
        help="most sequences (prompts x n) one request may start "
        f"(default {DEFAULT_MAX_SEQUENCES_PER_REQUEST})",
    )
    add_lora_modules_arg(group)
    group.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --enable-lora)",
    )
    group.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=32 << 20,
        help="larger request bodies get 413 (default: 32 MiB)",
    )


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        served_model_name=args.served_model_name or args.model,
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_waiting_requests=args.max_waiting_requests,
        shutdown_timeout_s=args.shutdown_timeout_s,
        log_level=args.log_level,
        tool_call_parser=args.tool_call_parser,
        max_n=args.max_n,
        max_sequences_per_request=args.max_sequences_per_request,
        max_request_body_bytes=args.max_request_body_bytes,
        lora_modules=tuple(args.lora_modules),
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
    )
