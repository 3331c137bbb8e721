"""The OpenAI-compatible HTTP server: `vacpack serve`.

Modules: config (options), async_engine (the engine's own thread, bridged to asyncio), metrics
(Prometheus), app (routes), launch (start and graceful stop). Importing this package is cheap;
FastAPI is imported only by app and launch.
"""
