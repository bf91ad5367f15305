"""Request ids: every HTTP answer carries ``x-request-id``, as OpenAI's API does.

OpenAI's SDKs read the header as ``response._request_id`` (and ``with_raw_response``'s
``request_id``) so a user can quote it when something went wrong; here it also names the request
in the server's log line for each error, so the quoted id finds that line. A client (or a proxy such
as ``hetserve route``) that sends its own ``X-Request-Id`` gets it back and sees it in the log, as
vLLM does; one that is not a short printable token is replaced, so a header can never carry spaces,
control characters or a flood into the log.
"""

from __future__ import annotations

import contextvars
import uuid

HEADER = "x-request-id"
MAX_CLIENT_ID_CHARS = 128

_current: contextvars.ContextVar[str | None] = contextvars.ContextVar("hetserve_request_id", default=None)


def current_request_id() -> str | None:
    """The id of the request being answered on this task (None outside a request)."""
    return _current.get()


def _client_id(raw: bytes | None) -> str | None:
    if raw is None or not 0 < len(raw) <= MAX_CLIENT_ID_CHARS or not all(33 <= b <= 126 for b in raw):
        return None
    return raw.decode("ascii")


class RequestIds:
    """ASGI middleware: takes the request's id (the client's ``X-Request-Id`` where it is a usable
    token, else a fresh ``req_<hex>``), makes it ``current_request_id()`` for the request's task and
    adds it to the response's headers. It must be outside every middleware that answers on its own
    (``keys.KeyGate``'s 401), so those answers carry it too. ``answer(scope, receive, exc)``: the
    response to an unexpected failure (``keys.answer_error``: the app's own handler), given by the
    app's maker so this module imports none of the modules that read its id."""

    def __init__(self, app, answer):
        self.app, self.answer = app, answer

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = next((v for k, v in scope.get("headers", ()) if k == HEADER.encode()), None)
        rid = _client_id(sent) or f"req_{uuid.uuid4().hex}"
        _current.set(rid)  # this request's task has its own context: nothing to reset
        started = False

        async def with_id(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != HEADER.encode()]
                message = {**message, "headers": headers + [(HEADER.encode(), rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, with_id)
        except Exception as exc:
            # an unexpected failure would be answered by Starlette's outermost middleware, outside this
            # one and so without the id: answer it here, by the app's own handler (logged, OpenAI's shape)
            if started:
                raise
            response = await self.answer(scope, receive, exc)
            await response(scope, receive, with_id)
