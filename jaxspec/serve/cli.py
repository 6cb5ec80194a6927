"""`python -m jaxspec.serve [--host 127.0.0.1] [--port 8000]` with the model and engine flags of generate.

It takes the port first (a port in use fails at once, before any loading), loads the pair, compiles every program
(greedy and sampling variants) and only then serves, printing `ready: http://HOST:PORT` on stdout.
Bad input prints one line and exits with status 2.
"""

from __future__ import annotations

import os
import socket
import sys

from jaxspec.cli import Parser, run_cli  # stdlib-only imports: bad flags are answered before jax loads
from jaxspec.launch import add_engine_args, add_model_args, build_engine, check_args, load_pair


def parse_args(argv=None):
    p = Parser(prog="python -m jaxspec.serve", description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (the ready line says which)")
    p.add_argument("--served-model-name", default=None, help="the model id of /v1/models (default: --model)")
    add_engine_args(p)
    p.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"), default="warning",
                   help="uvicorn's log level (info: one line per HTTP request)")
    return p.parse_args(argv)


def listen(host: str, port: int) -> socket.socket:
    from jaxspec.config import ConfigError

    if not 0 <= port <= 65535:
        raise ConfigError(f"--port must be in 0..65535, got {port}")
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
        sock.listen(2048)
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def check_step_log() -> None:
    """$JAXSPEC_STEP_LOG (the engine thread's per-step log, `jaxspec.serve.bridge`) must be a file it can append to."""
    from jaxspec.config import ConfigError

    path = os.environ.get("JAXSPEC_STEP_LOG")
    if path:
        try:
            open(path, "a").close()
        except OSError as e:
            raise ConfigError(f"JAXSPEC_STEP_LOG={path}: cannot append to it: {e.strerror or e}") from None


def run(args) -> int:
    check_args(args)  # the engine flags and the model folders' configs, before the port is taken or jax loads
    check_step_log()
    sock = listen(args.host, args.port)
    import jax
    import uvicorn

    from jaxspec.engine import freeze_heap
    from jaxspec.serve.app import create_app

    pair = load_pair(args)
    engine = build_engine(args, pair)
    print(f"model: {pair.label}; draft: {engine.config.draft_mode}" + (f" k={engine.k}" if engine.k else "") +
          f"; {jax.default_backend()} {jax.numpy.dtype(pair.params['embed'].dtype).name}; compiling", file=sys.stderr)
    engine.warmup(sample=True)
    freeze_heap()
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    name = args.served_model_name or args.model

    def ready():
        print(f"ready: {url} (model {name!r}, {engine.runner.programs_compiled} programs compiled)", flush=True)

    app = create_app(engine, name, on_ready=ready)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, access_log=args.log_level in ("info", "debug"),
                                           timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
    return 0


def main(argv=None) -> int:
    return run_cli(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
