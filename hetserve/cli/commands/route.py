"""``hetserve route``: the OpenAI API in front of a bundle's backends (deploy.json) or of URLs."""

from __future__ import annotations

import argparse
import sys

from hetserve.cli.http_options import add_key_options, bind, check_host, key_options


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "route", help="front OpenAI-compatible backends (a bundle's deploy.json, or URLs) with placement and retries",
        description="Serve the OpenAI API and forward each request to one of the backends: the plan's weights "
                    "(or a placement policy) choose; a backend that fails is taken out until its health check "
                    "passes, and a request that has not streamed yet is retried on another; P/D plans follow "
                    "vLLM's disaggregated-proxy protocol (docs/deploy.md).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--deploy", metavar="deploy.json", help="a bundle's deploy.json (hetserve export)")
    src.add_argument("--backends", metavar="URL,URL", help="colocated backends' base URLs, equal weights")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--policy", default="weights", choices=("weights", "jsq", "rr", "lot", "po2"),
                   help="weights (default): the plan's request shares; or a placement policy over in-flight counts")
    p.add_argument("--health-interval", type=float, default=1.0, metavar="S",
                   help="seconds between health checks of every backend (default 1; 0: none)")
    p.add_argument("--health-failures", type=int, default=3, metavar="N",
                   help="failed health checks in a row (slow or not 200) that take a backend out (default 3); "
                        "a refused connection takes it out at once")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S", help="per-request timeout (default 600)")
    p.add_argument("--stall-timeout", type=float, default=10.0, metavar="S",
                   help="a request waiting this long on a backend that health checks have taken out and that "
                        "answers them not at all (frozen, or its host gone; a 503 is an answer) fails as a broken "
                        "connection does: not yet streaming, it moves to another backend; streaming, it ends with an "
                        "error event (default 10; non-streamed requests wait for their whole answer, so raise it "
                        "for long ones)")
    p.add_argument("--backend-api-key-file", metavar="FILE",
                   help="a file holding the key the backends want (mode 600: only its owner may read it)")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM / Ctrl-C: seconds in-flight requests get to finish (default 30); new ones get "
                        "503; a second signal ends those left at once")
    add_key_options(p, admin=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hetserve.errors import SpecError
    from hetserve.serve.keys import APIAuth, KeySet, read_key_file
    from hetserve.serve.route.app import Router
    from hetserve.serve.route.backends import BackendPool, config_from_backends_option, config_from_deploy
    from hetserve.serve.route.server import create_app
    from hetserve.serve.server import serve_plain, url_of

    check_host(args.host)
    if not args.stall_timeout > 0:
        raise SpecError("--stall-timeout", SpecError.OPTION, "seconds, above 0", args.stall_timeout)
    if not args.drain_timeout >= 0:
        raise SpecError("--drain-timeout", SpecError.OPTION, "seconds, 0 or more", args.drain_timeout)
    keys = key_options(args)
    auth = APIAuth(api_keys=KeySet(keys["api_keys"]), protect_probes=keys["protect_probes"])
    if args.deploy:
        config = config_from_deploy(args.deploy)
    else:
        config = config_from_backends_option(args.backends)
    key = None
    if args.backend_api_key_file:  # one key, from a file only its owner can read (as serve's key files)
        found = read_key_file(args.backend_api_key_file)
        if len(found) != 1:
            raise SpecError(args.backend_api_key_file, "--backend-api-key-file", "one key (the backends')",
                            f"{len(found)} keys")
        key = found[0]
    router = Router(BackendPool(config, args.policy), timeout_s=args.timeout, health_interval_s=args.health_interval,
                    api_key=key, health_failures=args.health_failures, stall_s=args.stall_timeout)
    sock = bind(args.host, args.port)  # before the banner: it names the port the OS picked for --port 0
    health = f"health every {args.health_interval:g} s" if args.health_interval else "no health checks"
    print(f"hetserve route on {url_of(sock)}: {len(config.backends)} backend(s) "
          f"({', '.join(f'{b.id} {b.url}' for b in config.backends)}), policy {args.policy}; "
          f"{health}; {'; '.join(auth.describe()[:2])}", file=sys.stderr, flush=True)
    try:
        serve_plain(create_app(router, auth), sock, router, drain_timeout_s=args.drain_timeout)
    except KeyboardInterrupt:  # a Ctrl-C before the server took over the signals: stopping is the normal end
        pass
    print("hetserve route stopped", file=sys.stderr, flush=True)
    return 0
