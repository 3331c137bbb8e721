"""vacpack's OpenAI server as a Ray Serve deployment: K replicas behind Serve's HTTP proxy.

Each replica loads the model once and runs the very app `vacpack serve` runs (routes, auth,
errors, streaming, metrics, the engine on its own thread), built after the constructor through
Serve's `__serve_build_asgi_app__` hook; Serve's lifespan handling starts and stops the engine
thread. Serve spreads requests over the replicas and streams server-sent events through.

In a Serve application of your own:

    from vacpack.ray import build_serve_app
    serve.run(build_serve_app("my-model", num_replicas=4, num_gpus=1), route_prefix="/")
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray import serve
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vacpack.llm import LLM
from vacpack.python_heap import freeze_startup_objects
from vacpack.ray.figures import replica_label, this_replica
from vacpack.server.async_engine import AsyncEngine
from vacpack.server.launch import build_server_app
from vacpack.server.options import ServerConfig

REPLICA_HEADER = "x-vacpack-replica"
# vacpack batches a replica's requests continuously: it wants many in flight at once, far more
# than Serve's default of a few per replica.
DEFAULT_MAX_ONGOING_REQUESTS = 256


class ReplicaHeader:
    """Says which replica answered (host and pid) on every response (pure ASGI, so that
    streaming and disconnects pass through untouched)."""

    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.app = app
        self._header = (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self._header]}
            await send(message)

        await self.app(scope, receive, send_with_header)


@serve.ingress()
class VacpackServer:
    """One replica: the model and its OpenAI app."""

    def __init__(
        self,
        model: str,
        engine_kwargs: Mapping[str, Any] | None = None,
        server_config: ServerConfig | None = None,
    ) -> None:
        self._llm = LLM(model, **dict(engine_kwargs or {}))
        self._config = server_config or ServerConfig(served_model_name=model)

    def __serve_build_asgi_app__(self) -> ASGIApp:
        app = build_server_app(self._llm, self._config)
        freeze_startup_objects()  # a replica serves this model until Serve stops it
        self._engine: AsyncEngine = app.state.async_engine
        app.add_middleware(ReplicaHeader, replica=replica_label(*this_replica()))
        return app

    def check_health(self) -> None:
        """Serve's periodic check of the replica: raising has Serve replace it. Where the
        engine thread has ended, or its steps keep failing (a fault that outlives its step,
        such as a CUDA device assert), the replica cannot serve again (AsyncEngine.
        health_problem); until the app has started its engine there is nothing to check."""
        engine: AsyncEngine | None = getattr(self, "_engine", None)
        if engine is None or not engine.started:
            return
        problem = engine.health_problem
        if problem is not None:
            raise RuntimeError(f"vacpack replica unhealthy: {problem}")


VacpackDeployment = serve.deployment(
    name="vacpack", max_ongoing_requests=DEFAULT_MAX_ONGOING_REQUESTS
)(VacpackServer)


def build_serve_app(
    model: str,
    engine_kwargs: Mapping[str, Any] | None = None,
    server_config: ServerConfig | None = None,
    *,
    num_replicas: int = 1,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    max_ongoing_requests: int = DEFAULT_MAX_ONGOING_REQUESTS,
) -> serve.Application:
    """The deployment bound to a model: give it to `serve.run`.

    `server_config` carries the served model name, API key and queue limits; its host and port
    are not the replicas' own but belong to Serve's proxy (`serve.start(http_options=...)`).
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    deployment = VacpackDeployment.options(
        num_replicas=num_replicas,
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
    )
    return deployment.bind(model, dict(engine_kwargs or {}), server_config)
