"""`bench serve`: the OpenAI server under N concurrent streaming clients: throughput, time to first token and
inter-token latency percentiles, one row per client count.

It measures a running server (`--url`) or starts `python -m jaxspec.serve` itself (`--model`, `--assistant`,
`--server-args`, this command's --page-size) on a free port and stops it afterwards. Each client sends
--requests-per-client streaming completions one after another (`max_tokens` = --max-tokens, `ignore_eos`, so every
request produces the same number of tokens); prompts cycle through --prompts. The H200 run of the default pair:

    python -m jaxspec.bench serve --server-args '--max-running-requests 32' --clients 1,8,32
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import subprocess
import sys
import time

import numpy as np

from jaxspec.bench.common import positive, print_table, sizes
from jaxspec.config import ConfigError
from jaxspec.launch import PROMPTS

PERCENTILES = (50, 90, 99)


def add_args(p) -> None:
    p.add_argument("--url", help="a running server (http://host:port); default: start one")
    p.add_argument("--model", default="gemma3-270m", help="the model of the server this starts (serve's --model)")
    p.add_argument("--assistant", help="the assistant of the server this starts")
    p.add_argument("--server-args", default="", help="more flags for the server this starts, e.g. '-k 3 "
                   "--max-running-requests 32'")
    p.add_argument("--clients", type=sizes, default=[1, 8, 32], help="concurrent clients, a row each")
    p.add_argument("--requests-per-client", type=positive, default=4)
    p.add_argument("--max-tokens", type=positive, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--prompts", default=PROMPTS, help=".txt (one prompt a line) or .jsonl ('prompt' or "
                   "'prompt_ids'); default: the bundled prompts")


def read_prompts(path: str) -> list:
    """Prompts as the API takes them: strings or token-id lists (the server tokenizes)."""
    from jaxspec.prompts import read_jsonl

    if path.endswith(".jsonl"):
        out = [o.get("prompt_ids", o.get("prompt")) for _, o in read_jsonl(path) if isinstance(o, dict)]
    elif os.path.isfile(path):
        with open(path) as f:
            out = [line for line in f.read().splitlines() if line.strip()]
    else:
        raise ConfigError(f"prompts file not found: {path}")
    if not out or any(p is None for p in out):
        raise ConfigError(f"{path}: expected prompts ('prompt' or 'prompt_ids' on every .jsonl line)")
    return out


@contextlib.contextmanager
def server(args):
    """The base URL of the server to measure: --url, or one started here for the duration."""
    if args.url:
        yield args.url.rstrip("/")
        return
    cmd = [sys.executable, "-m", "jaxspec.serve", "--model", args.model, "--port", "0", "--page-size",
           str(args.page_size), *(["--assistant", args.assistant] if args.assistant else []),
           *shlex.split(args.server_args)]
    print("starting:", shlex.join(cmd), file=sys.stderr)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        line = proc.stdout.readline()
        if not line.startswith("ready: "):
            raise ConfigError(f"the server did not start (exit status {proc.wait()}); its error is above")
        print(f"{line.strip()} after {time.monotonic() - t0:.0f} s", file=sys.stderr)
        yield line.split()[1]
    finally:
        proc.terminate()
        proc.wait(60)


async def one_request(http, url: str, prompt, args) -> dict:
    """Send one streaming completion; the arrival time and token count of each chunk."""
    body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": args.temperature, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times, counts, usage = [], [], None
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise ConfigError(f"the server answered {r.status_code}: {(await r.aread()).decode()[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise ConfigError(f"the server failed a request: {chunk['error']['message']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices"):
                (c,) = chunk["choices"]
                n = len(c["token_ids"]) if "token_ids" in c else 1  # another server: count chunks
                if n:
                    times.append(time.perf_counter() - t0)
                    counts.append(n)
    tokens = usage["completion_tokens"] if usage else sum(counts)
    return {"times": times, "tokens": tokens}


async def run_clients(url: str, clients: int, prompts: list, args) -> tuple[list[dict], float]:
    import httpx

    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=clients + 1)) as http:
        await one_request(http, url, prompts[0], args)  # warm: the first request's one-time costs stay out

        async def client(c):
            return [await one_request(http, url, prompts[(c * args.requests_per_client + i) % len(prompts)], args)
                    for i in range(args.requests_per_client)]

        t0 = time.perf_counter()
        per_client = await asyncio.gather(*(client(c) for c in range(clients)))
        return [r for rs in per_client for r in rs], time.perf_counter() - t0


def scrape(url: str) -> dict:
    import httpx

    with contextlib.suppress(httpx.HTTPError, ValueError):
        lines = httpx.get(url + "/metrics", timeout=10).text.splitlines()
        return {k: float(v) for k, v in (x.split() for x in lines if x and not x.startswith("#"))}
    return {}


def served_model(url: str) -> str | None:
    import httpx

    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError):
        return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    return None


def row(clients: int, results: list[dict], wall: float, before: dict, after: dict) -> dict:
    ttft = [r["times"][0] * 1000 for r in results if r["times"]]
    itl = [(b - a) * 1000 for r in results for a, b in zip(r["times"], r["times"][1:])]
    tokens = sum(r["tokens"] for r in results)
    out = {"clients": clients, "requests": len(results), "output_tokens": tokens, "wall_s": wall,
           "throughput_tokens_per_s": tokens / wall, "requests_per_s": len(results) / wall,
           # per request: the decode time after the first chunk over the tokens after the first
           "tpot_ms_mean": float(np.mean([(r["times"][-1] - r["times"][0]) * 1000 / (r["tokens"] - 1)
                                          for r in results if r["tokens"] > 1 and r["times"]] or [0.0])),
           "tokens_per_chunk": tokens / max(sum(len(r["times"]) for r in results), 1)}
    for p in PERCENTILES:
        out[f"ttft_ms_p{p}"] = float(np.percentile(ttft, p)) if ttft else None
        out[f"itl_ms_p{p}"] = float(np.percentile(itl, p)) if itl else None
    # jaxspec's own counters (None from another server): what the row's requests took on the device
    diff = {k: after[k] - before.get(k, 0) for k in after}
    out["device_rounds"] = diff.get("jaxspec_decode_rounds_total")
    rounds = diff.get("jaxspec_request_rounds_total")
    out["mean_accept_length"] = diff["jaxspec_accepted_tokens_total"] / rounds if rounds else None
    out["server_counters"] = {k.removeprefix("jaxspec_"): v for k, v in diff.items()
                              if k.endswith("_total") and k in before}  # the row's share of every counter
    h = "jaxspec_engine_step_duration_seconds"
    if f"{h}_count" in diff:  # engine steps in the row, and how many took over 0.25 s (stalls)
        out["server_counters"]["engine_steps"] = diff[f"{h}_count"]
        out["server_counters"]["engine_steps_over_250ms"] = diff[f"{h}_count"] - diff[f'{h}_bucket{{le="0.25"}}']
    return out


def run(args) -> dict:
    """the OpenAI server under N concurrent streaming clients: throughput, TTFT, inter-token latency"""
    import httpx

    prompts = read_prompts(args.prompts)
    rows = []
    with server(args) as url:
        for clients in args.clients:
            before = scrape(url)
            try:
                results, wall = asyncio.run(run_clients(url, clients, prompts, args))
            except httpx.HTTPError as e:
                raise ConfigError(f"{url}: {e}") from None
            rows.append(row(clients, results, wall, before, scrape(url)))
            args.write_partial({"rows": rows})
        model = served_model(url)
    columns = [("clients", "clients", "{}"), ("requests", "requests", "{}"),
               ("throughput_tokens_per_s", "tok/s", "{:.1f}"), ("tpot_ms_mean", "tpot ms", "{:.2f}"),
               *[(f"ttft_ms_p{p}", f"ttft p{p}", "{:.1f}") for p in PERCENTILES],
               *[(f"itl_ms_p{p}", f"itl p{p}", "{:.2f}") for p in PERCENTILES],
               ("tokens_per_chunk", "tok/chunk", "{:.2f}"), ("mean_accept_length", "accept", "{:.2f}")]
    print_table(f"bench serve: {args.requests_per_client} requests per client, {args.max_tokens} tokens each "
                f"(ms)", columns, rows)
    timing = [{"clients": r["clients"], "wall_s": r["wall_s"], **(r.get("server_counters") or {})} for r in rows]
    if any(len(t) > 2 for t in timing):  # a jaxspec server: where its engine thread's time went
        names = ["engine_step_seconds_total", "engine_prefill_seconds_total", "engine_launch_seconds_total",
                 "engine_wait_seconds_total", "engine_commit_seconds_total", "gc_pause_seconds_total"]
        engine = [("clients", "clients", "{}"), ("wall_s", "wall", "{:.2f}"),
                  *[(n, n.removeprefix("engine_").removesuffix("_seconds_total"), "{:.2f}") for n in names],
                  ("decode_calls_total", "decode calls", "{:.0f}"), ("prefill_calls_total", "prefills", "{:.0f}"),
                  ("engine_steps", "steps", "{:.0f}"), ("engine_steps_over_250ms", "steps > 0.25 s", "{:.0f}"),
                  ("gc_full_collections_total", "full gc", "{:.0f}"), ("gc_collections_total", "gc", "{:.0f}")]
        print_table("the server's engine thread (s), its calls and the garbage collector's pauses", engine,
                    [{key: t.get(key) for key, _, _ in engine} for t in timing])
    return {"server": args.url or f"started: --model {args.model} {args.server_args}".strip(), "model": model,
            "max_tokens": args.max_tokens, "requests_per_client": args.requests_per_client,
            "temperature": args.temperature, "rows": rows}
