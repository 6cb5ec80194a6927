"""`python -m jaxspec.serve` end to end: one server subprocess (the tiny e2b pair with a word-level tokenizer and a chat
template) driven by the official `openai` client, against `python -m jaxspec.generate --output` for the same prompts
and flags; bad requests; a client that disconnects; incremental text on a byte-level tokenizer."""

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from conftest import golden_path

ENGINE = ["--assistant", golden_path("e2b", "assistant"), "--draft-bs", "8", "--max-running-requests", "8",
          "--page-size", "4", "--max-context", "128", "--prefill-chunk", "8"]
TEMPLATE = "{% for m in messages %}w10 {{ m['content'] }} w11 {% endfor %}{% if add_generation_prompt %}w12{% endif %}"
PROMPTS = [" ".join(f"w{(37 * i + 11 * j) % 500 + 5}" for j in range(2 + i % 7)) for i in range(32)]
NEW = 12
SAMPLED = {"prompt": "w40 w41 w42", "temperature": 0.9, "top_p": 0.95, "seed": 5}


def word_tokenizer(d, chat_template=None):
    """Token i is the word 'w{i}' (0, 1, 3 are <pad>, <eos>, <unk>), saved into folder d (if given)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(512) if i not in (0, 1, 3)} | {"<pad>": 0, "<eos>": 1, "<unk>": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    fast.chat_template = chat_template
    if d:
        fast.save_pretrained(d)
    return fast


def env():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "XLA_FLAGS": os.environ.get("XLA_FLAGS", "--xla_backend_optimization_level=0")}


STEP_LOG = [None]  # the server's JAXSPEC_STEP_LOG file


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base URL, tokenizer, generate's greedy records, generate's sampled record). generate runs in this process
    while the server compiles in its own."""
    from jaxspec.generate import main as generate

    tmp = tmp_path_factory.mktemp("serve")
    model = tmp / "target"
    shutil.copytree(golden_path("e2b", "target"), model)
    tokenizer = word_tokenizer(model, TEMPLATE)
    err = open(tmp / "server.err", "w")
    STEP_LOG[0] = tmp / "steps.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "jaxspec.serve", "--model", str(model), *ENGINE, "--port", "0"],
                            env={**env(), "JAXSPEC_STEP_LOG": str(STEP_LOG[0])}, stdout=subprocess.PIPE, stderr=err,
                            text=True)
    try:
        (tmp / "p.txt").write_text("\n".join(PROMPTS) + "\n")
        gen = ["--model", str(model), *ENGINE, "--quiet", "--max-new-tokens", str(NEW)]
        assert generate(gen + ["--prompts", str(tmp / "p.txt"), "--output", str(tmp / "greedy.jsonl")]) == 0
        # a sampled request's tokens do not depend on its batch (DESIGN §3): one bucket is enough
        assert generate(gen + ["--draft-bs", "1", "--prompt", SAMPLED["prompt"], "--temperature",
                               str(SAMPLED["temperature"]), "--top-p", str(SAMPLED["top_p"]), "--seed",
                               str(SAMPLED["seed"]), "--output", str(tmp / "sampled.jsonl")]) == 0
        records = [json.loads(x) for x in (tmp / "greedy.jsonl").read_text().splitlines()]
        (record,) = [json.loads(x) for x in (tmp / "sampled.jsonl").read_text().splitlines()]
        line = proc.stdout.readline()
        assert line.startswith("ready: http://127.0.0.1:"), (line, (tmp / "server.err").read_text())
        yield line.split()[1], tokenizer, records, record
        assert proc.poll() is None, (tmp / "server.err").read_text()  # no request killed it
    finally:
        proc.terminate()
        proc.wait(30)
        err.close()
    assert "Traceback" not in (tmp / "server.err").read_text()


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def metrics(url) -> dict:
    lines = httpx.get(url + "/metrics").text.splitlines()
    return {k: float(v) for k, v in (x.split() for x in lines if x and not x.startswith("#"))}


def streamed(stream):
    """(text, token ids, finish_reason) of a streamed completion."""
    text, ids, reason = "", [], None
    for chunk in stream:
        (c,) = chunk.choices
        text += c.text
        ids += c.model_extra["token_ids"]
        reason = c.finish_reason or reason
    return text, ids, reason


def test_health_and_models(server):
    url = server[0]
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    (m,) = client(url).models.list().data
    assert m.id.endswith("target") and m.model_extra["max_model_len"] == 128


def test_32_concurrent_clients_equal_generate(server):
    """Half stream, half do not; up to 8 run at once (the rest queue); each output equals generate's."""
    url, _, records, _ = server
    c = client(url)

    def one(i):
        if i % 2:
            r = c.completions.create(model="m", prompt=PROMPTS[i], max_tokens=NEW, temperature=0)
            (ch,) = r.choices
            assert r.usage.prompt_tokens == len(records[i]["prompt_ids"])
            assert r.usage.completion_tokens == len(ch.model_extra["token_ids"])
            return ch.text, ch.model_extra["token_ids"], ch.finish_reason
        return streamed(c.completions.create(model="m", prompt=PROMPTS[i], max_tokens=NEW, temperature=0,
                                             stream=True))

    before = metrics(url)
    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(one, range(32)))
    for (text, ids, reason), rec in zip(got, records):
        assert ids == rec["output_ids"] and text == rec["text"] and reason == rec["finish_reason"]
    # the engine thread's counters: every request prefilled (up to 8 rows a call), its tokens counted, and the step
    # time's parts (prefill, launch, waiting, commit) within the step time
    d = {k.removeprefix("jaxspec_"): v - before[k] for k, v in metrics(url).items() if k.endswith("_total")}
    assert d["generated_tokens_total"] == sum(len(ids) for _, ids, _ in got)
    assert 4 <= d["prefill_calls_total"] <= 32 and d["decode_calls_total"] >= NEW - 1
    parts = sum(d[f"engine_{p}_seconds_total"] for p in ("prefill", "launch", "wait", "commit"))
    assert 0 < parts <= d["engine_step_seconds_total"] + 1e-6
    # the step-time histogram: cumulative buckets, +Inf = count, its sum the step time
    after, h = metrics(url), "jaxspec_engine_step_duration_seconds"
    buckets = [v for k, v in after.items() if k.startswith(h + "_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == after[h + "_count"] > 0
    assert after[h + "_sum"] == pytest.approx(after["jaxspec_engine_step_seconds_total"])
    # JAXSPEC_STEP_LOG: a line per step since the start, agreeing with the counters; phases within their step
    steps = [json.loads(x) for x in STEP_LOG[0].read_text().splitlines()]
    assert len(steps) == after[h + "_count"]
    assert sum(x["step_s"] for x in steps) == pytest.approx(after[h + "_sum"], abs=1e-3)
    for name in ("prefill_calls", "decode_calls"):
        assert sum(x[name] for x in steps) == after[f"jaxspec_{name}_total"]
    assert all(x["prefill_s"] + x["launch_s"] + x["wait_s"] + x["commit_s"] <= x["step_s"] + 1e-5 for x in steps)
    assert [x["t"] for x in steps] == sorted(x["t"] for x in steps)
    assert max(x["running"] for x in steps) == 8  # --max-running-requests: the rest queued
    assert max(x["waiting"] for x in steps) > 0


def test_sampled_request_equals_generate(server):
    url, _, _, rec = server
    r = client(url).completions.create(model="m", max_tokens=NEW, **SAMPLED)
    assert r.choices[0].model_extra["token_ids"] == rec["output_ids"]
    other = client(url).completions.create(model="m", max_tokens=NEW, **{**SAMPLED, "seed": 6})
    assert other.choices[0].model_extra["token_ids"] != rec["output_ids"]


def test_stream_with_usage_and_stop_string(server):
    url, _, records, _ = server
    # a stop string over two tokens: the first one's text must be held back until the second decides
    rec = next(r for r in records if len(r["text"].split()) > 5)
    stop = " ".join(rec["text"].split()[3:5])
    text, ids, reason = streamed(client(url).completions.create(
        model="m", prompt=PROMPTS[records.index(rec)], max_tokens=NEW, temperature=0, stop=[stop], stream=True))
    assert reason == "stop" and text == rec["text"][: rec["text"].index(stop)]
    assert ids == rec["output_ids"][: len(ids)]
    chunks = list(client(url).completions.create(model="m", prompt=[5, 6, 7], max_tokens=4, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == 3
    assert chunks[-1].usage.completion_tokens == sum(len(c.choices[0].model_extra["token_ids"]) for c in chunks[:-1])


def test_chat_renders_the_template(server):
    url, tokenizer, _, _ = server
    messages = [{"role": "system", "content": "w7 w8"}, {"role": "user", "content": "w20 w21 w22"}]
    ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                    add_special_tokens=False)["input_ids"]
    assert ids == [10, 7, 8, 11, 10, 20, 21, 22, 11, 12]
    c = client(url)
    plain = c.completions.create(model="m", prompt=ids, max_tokens=8, temperature=0)
    chat = c.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == plain.choices[0].text and chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == len(ids) and chat.choices[0].finish_reason == plain.choices[0].finish_reason
    chunks = list(c.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason


def test_disconnect_mid_stream_frees_pages(server):
    url = server[0]
    idle = metrics(url)
    assert idle["jaxspec_kv_pages_used"] == 0 and idle["jaxspec_requests_running"] == 0
    stream = client(url).completions.create(model="m", prompt=[5, 6, 7], max_tokens=120, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    next(iter(stream))
    assert metrics(url)["jaxspec_kv_pages_used"] > 0
    stream.close()
    for _ in range(100):
        now = metrics(url)
        if now["jaxspec_kv_pages_used"] == 0 and now["jaxspec_requests_running"] == 0:
            break
        time.sleep(0.05)
    assert now["jaxspec_kv_pages_used"] == 0 and now["jaxspec_swa_pages_used"] == 0
    assert now["jaxspec_requests_finished_total"] == idle["jaxspec_requests_finished_total"]  # cancelled, not done
    assert now["jaxspec_generated_tokens_total"] - idle["jaxspec_generated_tokens_total"] < 120


BAD = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [5, 512]}, "prompt"),  # the vocabulary is 0..511
    ({"prompt": [5, -1]}, "prompt"),
    ({"prompt": list(range(5, 130))}, "prompt"),  # longer than the context of 128
    ({"prompt": 5}, "prompt"),
    ({"prompt": ["w5", "w6"]}, "prompt"),
    ({"prompt": "w5", "n": 2}, "n"),
    ({"prompt": "w5", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "w5", "max_tokens": -4}, "max_tokens"),
    ({"prompt": "w5", "max_tokens": "8"}, "max_tokens"),
    ({"prompt": "w5", "temperature": -0.5}, "temperature"),
    ({"prompt": "w5", "top_p": 0}, "top_p"),
    ({"prompt": "w5", "top_p": 1.5}, "top_p"),
    ({"prompt": "w5", "stop": ""}, "stop"),
    ({"prompt": "w5", "stop": 3}, "stop"),
    ({"prompt": "w5", "stream": "yes"}, "stream"),
    ({"prompt": "w5", "logprobs": 2}, "logprobs"),
    ({"max_tokens": 3}, "prompt"),
    ("not json", None),
]


@pytest.mark.parametrize("body,param", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_request_gets_400_and_the_server_keeps_serving(server, body, param):
    url = server[0]
    kw = {"content": body} if isinstance(body, str) else {"json": body}
    r = httpx.post(url + "/v1/completions", headers={"content-type": "application/json"}, **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    ok = client(url).completions.create(model="m", prompt=[5, 6], max_tokens=2, temperature=0, extra_body={"x": 1})
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_bad_chat_requests(server):
    url = server[0]
    for body in ({"messages": []}, {"messages": [{"content": "w5"}]}, {"messages": "w5"}):
        r = httpx.post(url + "/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_chat_needs_a_template():
    from jaxspec.serve.protocol import ApiError, ChatRequest, chat_prompt

    body = ChatRequest(messages=[{"role": "user", "content": "w5"}])
    for tokenizer in (None, word_tokenizer(None)):
        with pytest.raises(ApiError) as e:
            chat_prompt(body, tokenizer)
        assert e.value.status == 400 and "template" in e.value.message


def test_incremental_text_keeps_multibyte_characters():
    """A byte-level BPE that knows only ASCII merges splits each non-ASCII character over several tokens: the streamed
    pieces must never show half a character, and must add up to the whole text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from jaxspec.engine import Request
    from jaxspec.serve.app import Reply
    from jaxspec.serve.bridge import Update

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello world, plain ascii text"] * 10, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    text = "héllo wörld 😀 日本語 ok"
    ids = fast(text)["input_ids"]
    assert len(ids) > len(text)  # characters do span several tokens
    reply = Reply(False, "m", fast, Request(prompt_ids=[1]))
    pieces = [reply.delta(ids[: n + 1], Update([t])) for n, t in enumerate(ids[:-1])]
    pieces.append(reply.delta(ids, Update([ids[-1]], "length", fast.decode(ids))))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_bench_serve_smoke(server, tmp_path):
    """`python -m jaxspec.bench serve --url` against the module's server: the rows and keys it promises (no timing
    is asserted: figures come from the H200)."""
    from jaxspec import bench

    url = server[0]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [5, 6, 7]}\n{"prompt": "w9 w10"}\n')
    path = tmp_path / "serve.json"
    bench.main(["serve", "--url", url, "--clients", "1,3", "--requests-per-client", "2", "--max-tokens", "5",
                "--prompts", str(prompts), "--json", str(path)])
    r = json.loads(path.read_text())
    assert r["subcommand"] == "serve" and r["model"].endswith("target")
    assert [(x["clients"], x["requests"], x["output_tokens"]) for x in r["rows"]] == [(1, 2, 10), (3, 6, 30)]
    for x in r["rows"]:
        assert x["throughput_tokens_per_s"] > 0 and x["device_rounds"] > 0 and x["mean_accept_length"] >= 1
        assert all(x[f"{m}_ms_p{p}"] is not None for m in ("ttft", "itl") for p in (50, 90, 99))


class FlakyEngine:
    """The engine's serving API, failing on purpose: add_request raises for prompt [666], step raises while a request
    with prompt [13] runs; others get one token a step and finish after two."""

    def __init__(self):
        from jaxspec.engine.engine import Stats

        self.running, self.stats = [], Stats()  # the engine's own counters, as /metrics reads them
        pool = types.SimpleNamespace(num_full_pages=9, num_free_full=8, num_swa_pages=9, num_free_swa=8)
        self.cache, self.scheduler = types.SimpleNamespace(pool=pool), types.SimpleNamespace(running=[], waiting=[])

    def add_request(self, req):
        if req.prompt_ids == [666]:
            raise RuntimeError("add failed")
        self.running.append(req)

    def has_work(self):
        return bool(self.running)

    def cancel(self, req):
        self.running.remove(req)

    def step(self):
        if any(r.prompt_ids == [13] for r in self.running):
            raise RuntimeError("step failed")
        for r in self.running:
            r.output_ids.append(7)
            r.finish_reason = "length" if len(r.output_ids) == 2 else None
        done, self.running = self.running, [r for r in self.running if not r.finished]
        return done


def test_engine_thread_survives_engine_errors():
    """An exception in the engine thread fails the requests it concerns (500) and the thread serves the next ones."""
    from jaxspec.engine import Request
    from jaxspec.serve.bridge import EngineThread

    async def main():
        bridge = EngineThread(FlakyEngine(), asyncio.get_running_loop())
        bridge.start()

        async def updates(prompt):
            sink, out = bridge.submit(Request(prompt_ids=prompt)), []
            while not out or not (out[-1].finish_reason or out[-1].error):
                out.append(await asyncio.wait_for(sink.get(), 10))
            return out

        try:
            (add,) = await updates([666])
            assert add.error.status == 500
            (step,) = await updates([13])
            assert step.error.status == 500
            ok = await updates([5])
            assert [u.tokens for u in ok] == [[7], [7]] and ok[-1].finish_reason == "length"
            assert bridge.alive() and bridge.snapshot.requests_failed == 1
        finally:
            bridge.stop()

    asyncio.run(main())


def test_bad_flags_exit_2(capsys, monkeypatch, tmp_path):
    """Bad flags, an unusable port or step-log file: one line, exit 2, before any model loads."""
    import socket

    from jaxspec.serve.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--port", "x"])
    assert e.value.code == 2
    assert main(["--port", "70000"]) == 2
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["--port", str(taken.getsockname()[1])]) == 2
    assert main(["--max-context", "0"]) == 2  # the engine flags are generate's, checked as generate checks them
    assert main(["--model", "/nonexistent"]) == 2
    monkeypatch.setenv("JAXSPEC_STEP_LOG", str(tmp_path / "no" / "such" / "steps.jsonl"))
    assert main([]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 6 and all(x.startswith("error: ") for x in lines), lines
    assert "--max-context" in lines[3] and "/nonexistent" in lines[4], lines
    assert "JAXSPEC_STEP_LOG" in lines[5] and "cannot append" in lines[5], lines
