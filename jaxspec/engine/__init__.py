"""The speculative decoding engine (DESIGN.md §3, §9): requests, scheduler, runner, stopping rules, the loop."""

from jaxspec.engine.config import DRAFT_MODES, EngineConfig
from jaxspec.engine.engine import Engine, freeze_heap
from jaxspec.engine.request import Request, SamplingParams, request_record

__all__ = ["DRAFT_MODES", "Engine", "EngineConfig", "Request", "SamplingParams", "freeze_heap", "request_record"]
