"""The command-line contract shared by `python -m jaxspec.{generate,distill,corpus}`: bad input prints one line on
stderr and exits with status 2 (argparse's default prints the whole usage first)."""

from __future__ import annotations

import argparse
import sys

from jaxspec.config import ConfigError


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def run_cli(run, *args) -> int:
    """run(*args), with a ConfigError printed as one line and turned into exit status 2."""
    try:
        return run(*args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
