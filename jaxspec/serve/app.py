"""The HTTP app (FastAPI): /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Handlers only parse, validate and wait on their request's update queue; the engine thread (`bridge.py`) does the
work. Streaming replies are server-sent events, one chunk per step that committed tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
import uuid

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from jaxspec.serve.bridge import STEP_BUCKETS, EngineThread, Update
from jaxspec.serve.protocol import (ApiError, ChatRequest, CompletionRequest, chat_prompt, checked_request,
                                    completion_prompt, sampling_params, stable_text, usage)


def create_app(engine, model_name: str, on_ready=None) -> FastAPI:
    """on_ready(): called once the engine thread runs, before the first request is accepted."""
    tokenizer = engine.tokenizer
    counter = itertools.count()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        app.state.bridge = EngineThread(engine, asyncio.get_running_loop())
        app.state.bridge.start()
        if on_ready:
            on_ready()
        yield
        app.state.bridge.stop()

    app = FastAPI(title="jaxspec", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(_, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def bad_body(_, e: RequestValidationError):
        err = e.errors()[0]
        loc = [x for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid" or not loc or not isinstance(loc[0], str):
            return JSONResponse(ApiError("the request body is not a JSON object").body(), status_code=400)
        # a union's failure names its first member ("prompt.str"): the field and what came are clearer
        field = loc[0]
        return JSONResponse(ApiError(f"invalid {field}: {err.get('msg')} (got {json.dumps(err.get('input'))[:80]})",
                                     field).body(), status_code=400)

    @app.get("/health")
    async def health():
        if not app.state.bridge.alive():
            return JSONResponse({"status": "engine thread stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "jaxspec", "max_model_len": engine.max_context}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(app.state.bridge.snapshot),
                                 media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HttpRequest):
        ids = completion_prompt(body, tokenizer)
        params = sampling_params(body, body.max_tokens, 16, tokenizer)
        req = checked_request(engine, ids, params, next(counter), "prompt")
        return await respond(http, body, req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: HttpRequest):
        ids = chat_prompt(body, tokenizer)
        params = sampling_params(body, body.max_completion_tokens or body.max_tokens, engine.max_context, tokenizer)
        req = checked_request(engine, ids, params, next(counter), "messages")
        return await respond(http, body, req, chat=True)

    async def respond(http: HttpRequest, body, req, chat: bool):
        bridge: EngineThread = app.state.bridge
        reply = Reply(chat, model_name if body.model is None else body.model, tokenizer, req)
        sink = bridge.submit(req)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(stream(bridge, req, sink, reply, include_usage), media_type="text/event-stream")
        tokens, last = [], None
        gone = asyncio.ensure_future(disconnected(http))
        try:
            while last is None or not (last.finish_reason or last.error):
                get = asyncio.ensure_future(sink.get())
                await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    bridge.cancel(req)
                    return None  # nobody is there to read a reply
                last = get.result()
                tokens += last.tokens
        finally:
            gone.cancel()
        if last.error:
            raise last.error
        return reply.whole(tokens, last)

    return app


async def disconnected(http: HttpRequest) -> None:
    """Returns when the client closes the connection (the body is read: what remains to receive is the disconnect)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def stream(bridge: EngineThread, req, sink: asyncio.Queue, reply: "Reply", include_usage: bool):
    """SSE lines: a chunk per update with text, the last with finish_reason, usage if asked, then [DONE]. A client
    that goes away cancels this generator (or it is closed): the request is cancelled and its pages freed."""
    done = False
    try:
        if reply.chat:
            yield sse(reply.chunk({"role": "assistant", "content": ""}, [], None))
        tokens, held = [], []  # held: committed ids whose text is not out yet
        while not done:
            u: Update = await sink.get()
            if u.error:
                done = True
                yield sse(u.error.body())
                break
            tokens += u.tokens
            held += u.tokens
            delta = reply.delta(tokens, u)
            done = u.finish_reason is not None
            if delta or done or reply.tokenizer is None:
                yield sse(reply.chunk(delta, held, u.finish_reason))
                held = []
        if include_usage and not u.error:
            yield sse(reply.usage_chunk(len(tokens)))
        yield "data: [DONE]\n\n"
    finally:
        if not done:
            bridge.cancel(req)


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class Reply:
    """The OpenAI response objects of one request (completion or chat), and its text as it streams."""

    def __init__(self, chat: bool, model: str, tokenizer, req):
        self.chat, self.model, self.tokenizer = chat, model, tokenizer
        self.prompt_tokens = len(req.prompt_ids)
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        # text that a stop string still being completed may cut is held back (vLLM does the same)
        self.hold = max((len(s) - 1 for s in req.params.stop), default=0)
        self.sent = ""

    def delta(self, tokens: list[int], u: Update) -> str:
        """The new text: the whole output decoded, less what was sent, less an unfinished character at its end."""
        if self.tokenizer is None:
            return ""
        if u.finish_reason:
            text = u.text
        else:
            text = stable_text(self.tokenizer, tokens)
            text = text[: len(text) - self.hold]
        if len(text) <= len(self.sent):
            return ""
        new, self.sent = text[len(self.sent):], text
        return new

    def _base(self) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model}

    def chunk(self, delta, token_ids: list[int], finish_reason: str | None) -> dict:
        if self.chat:
            choice = {"index": 0, "delta": delta if isinstance(delta, dict) else {"content": delta},
                      "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": delta, "token_ids": token_ids, "logprobs": None,
                      "finish_reason": finish_reason}
        return {**self._base(), "choices": [choice]}

    def usage_chunk(self, completion_tokens: int) -> dict:
        return {**self._base(), "choices": [], "usage": usage(self.prompt_tokens, completion_tokens)}

    def whole(self, tokens: list[int], last: Update) -> dict:
        text = last.text or ""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": last.finish_reason}
        else:
            choice = {"index": 0, "text": text, "token_ids": tokens, "logprobs": None,
                      "finish_reason": last.finish_reason}
        return {**self._base(), "object": "chat.completion" if self.chat else "text_completion",
                "choices": [choice], "usage": usage(self.prompt_tokens, len(tokens))}


def prometheus_text(s) -> str:
    """The Prometheus text exposition format (https://prometheus.io/docs/instrumenting/exposition_formats/)."""
    mean_accept = s.accepted_tokens / s.decode_rounds if s.decode_rounds else 0.0
    rows = [
        ("requests_running", "gauge", "requests decoding or prefilling", s.running),
        ("requests_waiting", "gauge", "requests queued for admission", s.waiting),
        ("kv_pages_used", "gauge", "full-pool KV pages held by requests", s.kv_pages_used),
        ("kv_pages_total", "gauge", "full-pool KV pages (the dummy page not counted)", s.kv_pages_total),
        ("swa_pages_used", "gauge", "sliding-window-pool pages held by requests", s.swa_pages_used),
        ("swa_pages_total", "gauge", "sliding-window-pool pages", s.swa_pages_total),
        ("generated_tokens_total", "counter", "tokens committed to requests", s.generated_tokens),
        ("accepted_tokens_total", "counter", "tokens committed by decode rounds", s.accepted_tokens),
        ("request_rounds_total", "counter", "decode rounds summed over requests", s.decode_rounds),
        ("mean_accept_length", "gauge", "tokens committed per request per decode round", mean_accept),
        ("decode_rounds_total", "counter", "speculative rounds the device ran", s.device_rounds),
        ("requests_finished_total", "counter", "requests that ran to a stop or their length", s.requests_finished),
        ("requests_failed_total", "counter", "requests failed by an engine error", s.requests_failed),
        ("decode_calls_total", "counter", "decode calls launched", s.decode_calls),
        ("prefill_calls_total", "counter", "prefill calls", s.prefill_calls),
        ("engine_step_seconds_total", "counter", "engine thread time inside engine.step()", s.step_seconds),
        ("engine_prefill_seconds_total", "counter", "step time spent on prefill calls", s.prefill_seconds),
        ("engine_launch_seconds_total", "counter", "step time reserving pages and launching decode calls",
         s.launch_seconds),
        ("engine_wait_seconds_total", "counter", "step time blocked on decode results", s.wait_seconds),
        ("engine_commit_seconds_total", "counter", "step time committing results", s.commit_seconds),
        ("gc_collections_total", "counter", "garbage collections of the server process", s.gc_collections),
        ("gc_full_collections_total", "counter", "full (generation 2) garbage collections", s.gc_full_collections),
        ("gc_pause_seconds_total", "counter", "time the garbage collector stopped the process", s.gc_seconds),
    ]
    out = []
    for name, kind, help_, value in rows:
        out += [f"# HELP jaxspec_{name} {help_}", f"# TYPE jaxspec_{name} {kind}", f"jaxspec_{name} {value}"]
    h = "jaxspec_engine_step_duration_seconds"
    out += [f"# HELP {h} engine.step() durations", f"# TYPE {h} histogram"]
    out += [f'{h}_bucket{{le="{"+Inf" if le == float("inf") else le}"}} {n}'
            for le, n in zip(STEP_BUCKETS, s.step_buckets)]
    out += [f"{h}_sum {s.step_seconds}", f"{h}_count {s.step_buckets[-1]}"]
    return "\n".join(out) + "\n"
