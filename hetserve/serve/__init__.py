"""The serving front: an OpenAI-compatible HTTP coordinator over the runtime engine.

    protocol.py        the OpenAI request / response bodies (pydantic)
    errors.py          API errors and the one place that turns exceptions into HTTP responses
    backend.py         the ``Backend`` protocol the front needs from an engine
    engine_backend.py  the runtime ``Engine`` (local processes or Ray actors) as a ``Backend``
    fake.py            an in-process fake ``Backend`` (tests of the HTTP logic, no torch)
    text.py            tokenizer interface, chat rendering, streaming detokenization, stop strings
    coordinator.py     check -> place (shared placement policies) -> generate -> account -> abort
    metrics.py         Prometheus series (own registry; replica and link series read at scrape time)
    app.py             the FastAPI routes and SSE streaming
    server.py          uvicorn in the foreground or on a background thread
    launch.py          ``ServeOptions`` -> engine + links + placement + app (``hetserve serve``)
    loadgen.py         replay a trace through the ``openai`` client and time every token

Modules that need FastAPI, uvicorn or torch import them themselves; importing this package does not.
"""
