"""`python -m jaxspec.serve`: an OpenAI-compatible HTTP server (completions, chat completions, streaming) with online
continuous batching on the engine's `add_request` / `step` API.

    protocol.py  the request bodies, their checks and translation to engine requests, error bodies, incremental text
    bridge.py    the engine thread: owns the engine, steps it, hands committed tokens to the event loop
    app.py       the FastAPI app: the endpoints, server-sent events, /metrics
    cli.py       the command line: the engine flags of generate, compile, listen
"""
