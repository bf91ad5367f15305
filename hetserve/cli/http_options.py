"""The HTTP options ``hetserve serve`` and ``hetserve route`` share: the API keys their clients need
(``hetserve.serve.keys``) and the address they listen on (``check_host``, ``bind``)."""

from __future__ import annotations

import argparse


def add_key_options(p: argparse.ArgumentParser, admin: bool = True) -> None:
    """The HTTP API's keys (``hetserve.serve.keys``); ``admin``: the /admin/* keys too."""
    p.add_argument("--api-key", action="append", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/* (repeatable: several keys; default: "
                        "$HETSERVE_API_KEY, comma-separated; none: the API is open). A key on the command line "
                        "shows in ps: prefer --api-key-file or the variable")
    p.add_argument("--api-key-file", action="append", metavar="PATH",
                   help="API keys, one per line, from a file only its owner can read (mode 600); repeatable")
    if admin:
        p.add_argument("--admin-key", action="append", metavar="KEY",
                       help="the key /admin/* (re-plan) requires (default: $HETSERVE_ADMIN_KEY; none: /admin/* is off)")
        p.add_argument("--admin-key-file", action="append", metavar="PATH",
                       help="admin keys, one per line, from a file only its owner can read (mode 600)")
    p.add_argument("--protect-probes", action="store_true",
                   help="/health and /metrics need an API key too (default: open, for load balancers and Prometheus)")


def key_options(args: argparse.Namespace) -> dict:
    """``ServeOptions``' key fields (``api_keys``, ``admin_keys``, ``protect_probes``) from the key
    options: a command-line key or key file wins over the environment variable. The variables are
    then removed from this process's environment, so the worker processes it starts do not inherit
    the keys. A parser without the admin options gives no admin key."""
    import os

    from hetserve.errors import SpecError
    from hetserve.serve.keys import ADMIN_KEY_ENV, API_KEY_ENV, keys_from

    api = keys_from(args.api_key, args.api_key_file, API_KEY_ENV, "--api-key")
    admin = (keys_from(args.admin_key, args.admin_key_file, ADMIN_KEY_ENV, "--admin-key")
             if hasattr(args, "admin_key") else [])
    if set(api) & set(admin):
        raise SpecError("--admin-key", "admin key", "a key that is not also an API key (an API key would open "
                                                     "/admin/*)")
    if args.protect_probes and not api:
        raise SpecError("--protect-probes", "api key", f"an API key (--api-key, --api-key-file or {API_KEY_ENV}); "
                                                       "without one the probes would stay open")
    for name in (API_KEY_ENV, ADMIN_KEY_ENV):
        os.environ.pop(name, None)
    return {"api_keys": tuple(api), "admin_keys": tuple(admin), "protect_probes": args.protect_probes}


def check_host(host: str) -> str:
    """``--host`` if it names one address: a wildcard (every interface) is refused, as for every other
    listener of hetserve (``docs/security.md``)."""
    from hetserve.errors import SpecError
    from hetserve.runtime.workers.rendezvous import check_bind_address

    try:
        return check_bind_address(host, "--host")
    except ValueError as exc:
        raise SpecError("--host", SpecError.OPTION, "one address of this machine that clients reach (e.g. 10.0.0.5 "
                        "or 127.0.0.1), not every interface", host) from exc


def bind(host: str, port: int):
    """The listening address taken before anything starts (a taken port or a host that is not this
    machine's fails in a second, with one line); port 0: the OS picks one, and the socket says which."""
    from hetserve.errors import SpecError
    from hetserve.serve.server import bind_socket

    try:
        return bind_socket(host, port)
    except (OSError, OverflowError) as exc:
        raise SpecError(f"{host}:{port}", "--host/--port", "an address this machine can listen on",
                        getattr(exc, "strerror", None) or str(exc)) from exc
