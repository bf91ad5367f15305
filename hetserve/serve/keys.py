"""API keys of the HTTP front: which requests need which key, and where keys come from.

    KeySet(["k1", "k2"]).matches(token)      constant time over every key
    APIAuth(api_keys=KeySet(...), admin_keys=KeySet(...), protect_probes=False)
    keys_from(options, files, "HETSERVE_API_KEY", "--api-key")   the keys a command line / environment gives

Rules (``APIAuth.required``, applied to every request of ``hetserve serve``'s app and of ``hetserve
route``'s by ``KeyGate``, on the request's path before any routing):

- ``/admin/*`` needs an admin key; with no admin key configured those routes do not exist (404).
  An API key never opens them.
- ``/health`` and ``/metrics`` are open unless ``protect_probes``; then they need an API key.
- every other path (``/v1/*``, known or not, any method, and anything added later) needs an API key
  when at least one is set: a caller without one learns nothing of which routes exist (401 before
  the router could answer 404 or 405).

Keys are kept only as SHA-256 digests and compared with ``hmac.compare_digest`` against every
configured digest (no early exit): the time a check takes says nothing about how much of a key was
right, nor about its length, nor about which key matched.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from dataclasses import dataclass, field
from typing import Iterable

from starlette.requests import Request

from hetserve.errors import HetserveError
from hetserve.runtime.workers.auth import owner_only

API_KEY_ENV = "HETSERVE_API_KEY"
ADMIN_KEY_ENV = "HETSERVE_ADMIN_KEY"
PROBE_PATHS = frozenset({"/health", "/metrics"})
ADMIN_PREFIX = "/admin"


class KeyConfigError(HetserveError, ValueError):
    """A key, key file or key variable that cannot be used (the message names where it came from)."""


class KeySet:
    """A set of keys held as SHA-256 digests; ``repr`` shows only how many."""

    def __init__(self, keys: Iterable[str] = ()):
        if isinstance(keys, str):  # one string would otherwise become one key per character
            raise TypeError("KeySet takes a list of keys, not one string")
        self._digests = tuple(_digest(k) for k in keys)

    def __len__(self) -> int:
        return len(self._digests)

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __repr__(self) -> str:
        return f"KeySet({len(self._digests)} key{'s' if len(self._digests) != 1 else ''})"

    def matches(self, token: str | None) -> bool:
        """Whether ``token`` is one of the keys. Every digest is compared, whatever matched first."""
        presented = _digest(token if token is not None else "")
        found = False
        for ref in self._digests:
            found |= hmac.compare_digest(presented, ref)
        return found and token is not None


def _digest(key: str) -> bytes:
    # header values reach Python as latin-1 text (ASGI): encoding back gives the bytes that were sent
    return hashlib.sha256(key.encode("latin-1", errors="replace")).digest()


@dataclass(frozen=True)
class APIAuth:
    api_keys: KeySet = field(default_factory=KeySet)
    admin_keys: KeySet = field(default_factory=KeySet)
    protect_probes: bool = False

    def required(self, route_path: str) -> str | None:
        """Which key ``route_path`` (the matched route's path) needs: "admin", "api" or None (open)."""
        if route_path == ADMIN_PREFIX or route_path.startswith(ADMIN_PREFIX + "/"):
            return "admin"
        if route_path in PROBE_PATHS and not self.protect_probes:
            return None
        return "api" if self.api_keys else None

    def describe(self) -> list[str]:
        """Start-up lines saying what needs a key (never a key)."""
        n = len(self.api_keys)
        api = (f"API keys required on /v1/* ({n} key{'s' if n != 1 else ''} accepted)" if n else
               f"API open: no key required (--api-key or {API_KEY_ENV} to require one)")
        probes = ("/health and /metrics need an API key" if self.protect_probes and n else
                  "/health and /metrics open")
        admin = ("admin endpoints (/admin/*) on, behind the admin key" if self.admin_keys else
                 f"admin endpoints (/admin/*) off (--admin-key or {ADMIN_KEY_ENV} to enable)")
        return [api, probes, admin]


def refusal(auth: APIAuth, path: str, authorization: str | None):
    """The ``APIError`` a request for ``path`` with this ``Authorization`` header gets from ``auth``
    (401 without the key the path needs, 404 for ``/admin/*`` where no admin key is configured), or
    None when it may pass."""
    from hetserve.serve.errors import NotFound, Unauthorized

    need = auth.required(path)
    if need is None:
        return None
    token = bearer_token(authorization)
    if need == "admin":
        if not auth.admin_keys:  # off: indistinguishable from a route that does not exist
            return NotFound("Not Found")
        if not auth.admin_keys.matches(token):
            return Unauthorized("This endpoint needs the server's admin key, sent as 'Authorization: Bearer "
                                "<admin key>'." if token is None else "Incorrect admin key provided.")
        return None
    if not auth.api_keys.matches(token):
        return Unauthorized("You didn't provide an API key. Send it as 'Authorization: Bearer <key>'."
                            if token is None else "Incorrect API key provided.")
    return None


class KeyGate:
    """ASGI middleware holding every HTTP request to ``auth`` by its path, before routing: a key check
    on matched routes only would let a caller without a key tell routes that exist (401) from those
    that do not (404) or take another method (405). A refusal is answered by the app's own handler
    for ``APIError`` (``errors.install_error_handlers``: OpenAI's shape, logged and counted), as a
    route's error would be; the body is never read."""

    def __init__(self, app, auth: APIAuth):
        self.app, self.auth = app, auth

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            header = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"authorization"), None)
            err = refusal(self.auth, scope.get("path", ""), header)
            if err is not None:
                response = await answer_error(scope, receive, err)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def answer_error(scope, receive, err: BaseException):
    """The response the app's exception handler gives ``err`` (so it is logged and counted as any
    client error), or ``errors.error_response`` where the app has none; for middleware answering
    outside the app's own handlers."""
    from hetserve.serve.errors import error_response

    handlers = getattr(scope.get("app"), "exception_handlers", {})
    handler = next((handlers[cls] for cls in type(err).__mro__ if cls in handlers), None)
    if handler is None:
        return error_response(err, scope.get("path", ""))
    return await handler(Request(scope, receive), err)


def guarded_app(auth: APIAuth) -> dict:
    """FastAPI's options for an app whose every request ``auth`` holds: ``KeyGate`` as its middleware,
    inside ``request_ids.RequestIds`` (so a 401 carries ``x-request-id`` too), and no /openapi.json
    nor docs pages (nothing of the API's shape is served)."""
    from starlette.middleware import Middleware

    from hetserve.serve.request_ids import RequestIds

    return {"docs_url": None, "redoc_url": None, "openapi_url": None,
            "middleware": [Middleware(RequestIds, answer=answer_error), Middleware(KeyGate, auth=auth)]}


def bearer_token(header: str | None) -> str | None:
    """The credential of an ``Authorization: Bearer <token>`` header (scheme case-insensitive), or None."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def check_key(key: str, source: str) -> str:
    """``key`` if it can travel in a Bearer header: printable ASCII, no spaces, not empty."""
    if not key:
        raise KeyConfigError(f"{source}: an empty key")
    if not all(33 <= ord(ch) <= 126 for ch in key):
        raise KeyConfigError(f"{source}: a key must be printable ASCII without spaces (it travels in an "
                        f"'Authorization: Bearer <key>' header)")
    return key


def read_key_file(path: str) -> list[str]:
    """The keys in ``path``, one per line (blank lines and lines starting with '#' skipped). The file must
    be readable by its owner only: a key file others can read is refused, as ssh refuses such key files."""
    try:
        st = os.stat(path)
        with open(path, encoding="ascii") as f:
            text = f.read()
    except UnicodeDecodeError as exc:
        raise KeyConfigError(f"{path}: a key file holds ASCII keys, one per line") from exc
    except OSError as exc:
        raise KeyConfigError(f"{path}: cannot read the key file ({exc.strerror or exc})") from exc
    if not stat.S_ISREG(st.st_mode):
        raise KeyConfigError(f"{path}: not a regular file")
    mode = stat.S_IMODE(st.st_mode)
    if not owner_only(mode):
        raise KeyConfigError(f"{path}: the key file is accessible by group or others (mode {mode:04o}); "
                        f"run 'chmod 600 {path}'")
    keys = [check_key(line.strip(), f"{path} line {i}")
            for i, line in enumerate(text.splitlines(), 1) if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise KeyConfigError(f"{path}: the key file holds no key")
    return keys


def keys_from(options: Iterable[str] | None, files: Iterable[str] | None, env_name: str,
              option_name: str, environ=None) -> list[str]:
    """The keys the command line gives (``options`` and ``files``, together), else the environment
    variable ``env_name`` (comma-separated). A variable that is set but holds no key is refused rather
    than read as "no key": a misspelt or empty secret must not leave the server open."""
    environ = os.environ if environ is None else environ
    keys = [check_key(k, option_name) for k in options or ()]
    for path in files or ():
        keys += read_key_file(path)
    if keys or options or files:
        return _unique(keys)
    raw = environ.get(env_name)
    if raw is None:
        return []
    env_keys = [check_key(k.strip(), env_name) for k in raw.split(",") if k.strip()]
    if not env_keys:
        raise KeyConfigError(f"{env_name} is set but holds no key; unset it to serve without one")
    return _unique(env_keys)


def _unique(keys: list[str]) -> list[str]:
    return list(dict.fromkeys(keys))
