"""``fastwan serve``: OpenAI's Videos API over HTTP (FastAPI + uvicorn), one model loaded once, a FIFO job queue run
by one worker thread, jobs kept in SQLite so that an accepted job survives a crash.

Modules: :mod:`~fastwan.serve.server` (the command's flags and start-up), :mod:`~fastwan.serve.app` (the routes),
:mod:`~fastwan.serve.requests` (an OpenAI create body -> a checked :class:`~fastwan.GenerationRequest`),
:mod:`~fastwan.serve.store` (the job store), :mod:`~fastwan.serve.worker` (the model, the job loop, retention),
:mod:`~fastwan.serve.metrics` (``/metrics``) and :mod:`~fastwan.serve.errors` (OpenAI's error shape). Nothing is
imported here: FastAPI is an optional dependency (the ``serve`` extra).
"""
