"""The user cache: what jaxspec builds once and keeps (the converted default model, the unpacked bundled assistant,
XLA's compiled programs), and how a cache entry is built safely when several processes start together.

stdlib, filelock and jaxspec.config only at import time (jax loads only when the compile cache is turned on).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
from typing import Callable

from filelock import FileLock, Timeout

from jaxspec.config import ConfigError

MARKER = ".jaxspec-complete.json"  # written last into a built folder: its key and the size of every file
_LEGACY_TEMP = ".tmp"  # jaxspec 0.1 unpacked the assistant into `<name>.tmp<pid>`


def cache_root() -> str:
    """`$JAXSPEC_CACHE`, else `$XDG_CACHE_HOME/jaxspec`, else `~/.cache/jaxspec`."""
    if os.environ.get("JAXSPEC_CACHE"):
        return os.environ["JAXSPEC_CACHE"]
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxspec")


def _sizes(folder: str) -> dict[str, int]:
    return {name: os.path.getsize(os.path.join(folder, name)) for name in sorted(os.listdir(folder))
            if name != MARKER}


def is_complete(folder: str, key: dict) -> bool:
    """Whether `folder` is a finished build for `key`: its marker names `key`, and every file it lists is there with
    its recorded size (a truncated or missing file, or an unfinished build, is not complete)."""
    try:
        with open(os.path.join(folder, MARKER)) as f:
            marker = json.load(f)
        return marker["key"] == key and all(os.path.getsize(os.path.join(folder, name)) == size
                                            for name, size in marker["files"].items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _remove_leftovers(root: str, name: str, lock_name: str) -> None:
    """Delete the temp folders of builds of `name` that never finished (their process was killed). Called under the
    entry's lock: no build of `name` is running, so every such folder is a leftover."""
    for entry in os.listdir(root):
        if entry != lock_name and (entry.startswith(f".{name}.") or entry.startswith(name + _LEGACY_TEMP)):
            path = os.path.join(root, entry)
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.remove(path)


def _share(folder: str) -> None:
    """mkdtemp makes a private folder (and safetensors private files); a cache entry gets the umask's modes."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for name in os.listdir(folder):
        os.chmod(os.path.join(folder, name), 0o666 & ~umask)


def cached_folder(name: str, key: dict, build: Callable[[str], None], what: str) -> str:
    """`<cache>/<name>`, a folder that `build(tmp)` fills, built once for `key` (a JSON-able dict naming its source).

    A complete folder (`is_complete`) is returned as it is. Otherwise, under a file lock (so concurrent first runs
    build it once: the others wait, then find it complete), `build` fills a hidden temp folder beside it, the marker is
    written last, and the temp folder is renamed into place: a killed build never leaves a folder that looks
    complete, and its temp folder is removed by the next build. An incomplete folder (a missing or truncated file, an
    older format) is replaced. `what` names the work in the one line printed on stderr.
    """
    root = cache_root()
    out = os.path.join(root, name)
    if is_complete(out, key):
        return out
    try:
        return _build_locked(root, name, key, build, what)
    except OSError as e:  # an unwritable cache folder, a full disk
        raise ConfigError(f"cannot build {out}: {e} (JAXSPEC_CACHE chooses the cache folder)") from None


def _build_locked(root: str, name: str, key: dict, build: Callable[[str], None], what: str) -> str:
    out = os.path.join(root, name)
    os.makedirs(root, exist_ok=True)
    lock_name = f".{name}.lock"
    lock = FileLock(os.path.join(root, lock_name))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"jaxspec: waiting for another process {what} into {out}", file=sys.stderr)
        lock.acquire()
    try:
        if is_complete(out, key):  # built by the process we waited for
            return out
        _remove_leftovers(root, name, lock_name)
        print(f"jaxspec: {what} into {out} (once)", file=sys.stderr)
        tmp = tempfile.mkdtemp(prefix=f".{name}.", dir=root)
        try:
            build(tmp)
            with open(os.path.join(tmp, MARKER), "w") as f:
                json.dump({"key": key, "files": _sizes(tmp)}, f)
            _share(tmp)
            if os.path.lexists(out):  # incomplete: moved aside (a leftover if we are killed now), then swapped
                os.replace(out, os.path.join(tempfile.mkdtemp(prefix=f".{name}.old.", dir=root), name))
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # a failed build's files; nothing once renamed
        _remove_leftovers(root, name, lock_name)
    finally:
        lock.release()
    return out


# ---- JAX's persistent compilation cache -------------------------------------------------------------------------

_hits = 0  # programs loaded from the persistent compilation cache in this process
_hits_lock = threading.Lock()
_listening = False


def compile_cache_dir() -> str:
    return os.path.join(cache_root(), "xla")


def enable_compile_cache() -> str:
    """Turn on JAX's persistent compilation cache in `<cache>/xla` for this process (call it before the first
    compile); returns the folder. Every program is kept, however fast it compiled (jax's defaults skip compiles under
    1 s): on a CPU many small programs compile in about a second, and reading one back costs far less.
    The key covers the program, the compiler options (e.g. the draft buckets' `xla_allow_excess_precision`), XLA
    flags, the jax version and the device."""
    import jax

    global _listening
    if not _listening:
        jax.monitoring.register_event_listener(_count_hits)
        _listening = True
    path = compile_cache_dir()
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path


def _count_hits(event: str, **_) -> None:
    global _hits
    if event == "/jax/compilation_cache/cache_hits":
        with _hits_lock:  # programs compile side by side (`jaxspec.aot.compile_all`)
            _hits += 1


def compile_cache_hits() -> int:
    """Programs this process has loaded from the persistent compilation cache so far."""
    return _hits
