"""The ``hetserve`` command: a thin shell that parses, calls and prints.

Each subcommand lives in its own module under ``hetserve.cli.commands`` and exposes
``register(subparsers)``, which adds its parser and sets ``func`` to a callable taking the parsed
args and returning an exit code. Modules are discovered, so a new command is a new file.

Every ``HetserveError`` (and an ``OSError`` naming a file) becomes one line on stderr and exit code 2;
no traceback unless ``HETSERVE_DEBUG=1``. Output cut short by its reader (``hetserve ... | head``) ends
the command quietly with exit code 0, whether or not the write raced the reader's exit.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import select
import sys

from hetserve import __version__
from hetserve.cli.bounds import OneLineParser, apply_bounds
from hetserve.errors import HetserveError


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="hetserve",
        description="Plan, simulate and serve LLMs on heterogeneous GPU pools.")
    parser.add_argument("--version", action="version", version=f"hetserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    from hetserve.cli import commands

    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"hetserve.cli.commands.{info.name}")
        module.register(sub)
    apply_bounds(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    # rich meets a closed pipe by exiting 1; hand it to the one rule below instead
    Console.on_broken_pipe = _reraise_broken_pipe
    try:
        code = _main(argv)
        sys.stdout.flush()  # what is still buffered meets a closed pipe here, not at exit
        return code
    except BrokenPipeError:
        if not _stdout_closed():  # a socket's, say: a real failure, not a reader that stopped
            raise
        # the reader has what it wanted, and so has the user: a quiet success, as whenever the
        # whole output fitted the pipe before the reader left. Python's exit flush goes nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _reraise_broken_pipe(console) -> None:
    raise BrokenPipeError


def _stdout_closed() -> bool:
    """Whether stdout is a pipe (or socket) whose reader has gone."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # captured output (io.StringIO): never closed
        return False
    poll = select.poll()
    poll.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # a refused option (one line already printed), --help or --version
        return int(exc.code or 0)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    # the command's name (and its subcommand's, dest ``<command>_command``) leads its error lines,
    # as argparse's own refusals of its options do
    command = getattr(args, "command", None)
    prog = " ".join(["hetserve", *(w for w in (command, getattr(args, f"{command}_command", None)) if w)])
    try:
        return int(args.func(args) or 0)
    except HetserveError as exc:
        if os.environ.get("HETSERVE_DEBUG"):
            raise
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        # a path the user named that cannot be read or written (-o onto an existing file, a folder
        # that cannot be made): one line naming it, as for any other bad input
        if exc.filename is None or os.environ.get("HETSERVE_DEBUG"):
            raise
        print(f"{prog}: error: {exc.filename}: expected a path that can be written or read, "
              f"got '{exc.strerror}'", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hetserve: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
