"""The OpenAI wire format: request bodies (pydantic), their translation to the engine's `Request`, error bodies and
incremental text.

Unknown fields are tolerated (clients send many); a field the engine cannot honour (`n` > 1, `logprobs`, `echo`)
is refused rather than ignored, so no reply silently differs from what was asked.
"""

from __future__ import annotations

import secrets
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from jaxspec.config import ConfigError
from jaxspec.engine import Request, SamplingParams

INT32 = 2**31


class ApiError(Exception):
    """A request the server refuses: HTTP `status` with OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False


class _Sampling(BaseModel):
    """The fields both endpoints share. Strict: "5" is not a number and true is not 1."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # vLLM's extension; 0 or -1: off
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: Any = None
    ignore_eos: bool = False  # vLLM's extension


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[dict] | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: until EOS or the context
    max_completion_tokens: int | None = None


def sampling_params(body: _Sampling, max_tokens: int | None, default_max: int, tokenizer) -> SamplingParams:
    if body.n != 1:
        raise ApiError("only n = 1 is supported", "n")
    if body.logprobs not in (None, False):
        raise ApiError("logprobs are not supported", "logprobs")
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
    if body.temperature < 0:
        raise ApiError(f"temperature must be >= 0, got {body.temperature}", "temperature")
    if not 0 < body.top_p <= 1:
        raise ApiError(f"top_p must be in (0, 1], got {body.top_p}", "top_p")
    if body.top_k < -1:
        raise ApiError(f"top_k must be >= 0 (0 or -1: off), got {body.top_k}", "top_k")
    if body.seed is not None and not -INT32 <= body.seed < INT32:
        raise ApiError(f"seed must fit in 32 bits, got {body.seed}", "seed")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if any(not s for s in stop):
        raise ApiError("stop strings must not be empty", "stop")
    if stop and tokenizer is None:
        raise ApiError("stop strings need a tokenizer and this model has none", "stop")
    # OpenAI: without a seed, samples differ between calls
    seed = secrets.randbelow(INT32) if body.seed is None else body.seed
    return SamplingParams(max_new_tokens=max_tokens or default_max, temperature=body.temperature,
                          top_k=max(body.top_k, 0), top_p=body.top_p, seed=seed, stop=stop,
                          ignore_eos=body.ignore_eos)


def completion_prompt(body: CompletionRequest, tokenizer) -> list[int]:
    prompt = body.prompt
    if body.echo:
        raise ApiError("echo is not supported", "echo")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise ApiError("one prompt per request (a list of prompts is a batch, which needs n > 1)", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError("the prompt is empty", "prompt")
        if tokenizer is None:
            raise ApiError("this model has no tokenizer: give the prompt as a list of token ids", "prompt")
        return tokenizer(prompt)["input_ids"]
    return list(prompt)


def chat_prompt(body: ChatRequest, tokenizer) -> list[int]:
    if tokenizer is None:
        raise ApiError("this model has no tokenizer, so no chat template: use /v1/completions with token ids",
                       "messages")
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError("this model's tokenizer has no chat template: use /v1/completions", "messages")
    messages = []
    for m in body.messages:
        content = m.content
        if isinstance(content, list):  # content parts: only text ones carry meaning for a text model
            if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
                raise ApiError("only text content parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        messages.append({"role": m.role, "content": content or ""})
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # a template may reject a conversation (e.g. roles out of order) by raising
        raise ApiError(f"the chat template rejected the messages: {e}", "messages") from None
    # the template writes the special tokens (BOS) itself
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def checked_request(engine, prompt_ids: list[int], params: SamplingParams, index: int, param: str) -> Request:
    """The engine's own checks (`Engine.validate`, as generate runs them): the server and generate agree."""
    req = Request(prompt_ids=prompt_ids, params=params, index=index)
    try:
        engine.validate(req)
    except ConfigError as e:
        raise ApiError(str(e), param) from None
    return req


def stable_text(tokenizer, output_ids: list[int]) -> str:
    """The decoded output that later tokens cannot change: a trailing U+FFFD is an incomplete multi-byte character
    (its remaining bytes are in tokens not yet committed), so it is held back."""
    return tokenizer.decode(output_ids, skip_special_tokens=True).rstrip("\ufffd")


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
