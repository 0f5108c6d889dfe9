"""The applications over the runtime: what `specrun` runs beyond one generation.

    server.py, plumbing.py, slots.py,  `specrun serve`: the OpenAI HTTP API (app and routes,
    metrics.py, openai_api.py,         the HTTP plumbing under them; the decode slots and their
    openai_protocol.py, run_server.py  worker threads; Prometheus metrics; requests made into
                                       jobs, errors and responses; the API's shapes as pydantic
                                       models; uvicorn and the drain)
    ray_serve.py                       `specrun serve --ray`: the same app in Ray Serve replicas
    bench.py                           `specrun bench`: speculative vs target-only, alternating
    check.py, twosample.py             `specrun check`: the exactness test on a bundle's graphs
    chat_session.py                    `specrun chat`: a conversation on one generator
    listing.py                         `specrun list`: the bundles on this machine

They use the numeric core (spec_runtime: load, Generator, GenerationOptions, ...) and nothing
of the core imports them (tests/test_hygiene.py holds the direction): `import spec_runtime`
loads no web framework (nor pydantic), starts no thread and installs no signal handler.
"""
