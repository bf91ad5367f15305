"""API errors and the one place that turns exceptions into HTTP responses.

    APIError                      an error the client gets as OpenAI's JSON shape
    ├── InvalidRequest (400)      malformed body, unsupported field, bad value
    │   └── ContextLengthExceeded prompt + max_tokens beyond the model's context or any replica's KV pool
    ├── PayloadTooLarge (413)     a request body over the server's limit (refused before it is all read)
    ├── Unauthorized (401)        no API key, or not one of the server's (``WWW-Authenticate: Bearer``)
    ├── ModelNotFound (404)       ``model`` is not the one this server serves
    ├── NotFound (404)            no such route
    ├── MethodNotAllowed (405)
    ├── Overloaded (503)          the server is shutting down or the engine is not ready
    │   ├── ShuttingDown (503)    refused or ended by the graceful shutdown (``shutting_down``); ``Retry-After`` set
    │   └── Unavailable (503)     no live replica can serve (every one lost a worker); ``Retry-After`` set
    └── ServerError (500)         anything unexpected (the engine failed mid-request, a worker died)

``install_error_handlers(app)`` maps every exception a route can raise — ``APIError``, FastAPI's
request validation errors, an unreadable JSON body, Starlette's HTTP exceptions, hetserve's own
``HetserveError`` and anything else — to ``{"error": {"message", "type", "param", "code"}}``.
Streaming responses that fail after their headers are sent carry the same object in one SSE
event (``error_event``), since the status line has already left. Each error's log line names the
request's ``x-request-id`` (``request_ids``), the id the client was given.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from hetserve.policies.request_checks import SIDE_WORDS, ContextExceeded, KVNeverFits, RequestRefused
from hetserve.serve.request_ids import current_request_id

log = logging.getLogger("hetserve.serve")


class APIError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.param = message, param
        self.headers = headers or {}
        if code is not None:
            self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequest(APIError):
    status, type = 400, "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


def refusal(exc: RequestRefused, prompt_param: str = "prompt") -> InvalidRequest:
    """The 400 a client sees for a request the deployment refuses (``policies.request_checks``: the
    engine's and the simulator's rules). The context wording is OpenAI's (and vLLM's): clients such
    as lm-evaluation-harness look for "maximum context length" to shorten and retry."""
    if isinstance(exc, ContextExceeded):
        ctx, prompt = exc.max_context, exc.prompt_tokens
        if prompt >= ctx:
            return ContextLengthExceeded(
                f"This model's maximum context length is {ctx} tokens, however your prompt has {prompt} tokens. "
                "Please reduce the length of the prompt.", param=prompt_param)
        return ContextLengthExceeded(
            f"This model's maximum context length is {ctx} tokens, however you requested {prompt + exc.max_tokens} "
            f"tokens ({prompt} in the prompt, {exc.max_tokens} for the completion). Please reduce the prompt or "
            "the completion length.", param="max_tokens")
    if isinstance(exc, KVNeverFits):
        # a prompt that fits with no completion length: the field to fix is the prompt itself
        fix = "the prompt" if exc.prompt_alone else "the prompt or the completion length"
        return ContextLengthExceeded(
            f"The request needs {exc.prompt_tokens + exc.max_tokens} tokens of KV cache ({exc.prompt_tokens} prompt "
            f"+ {exc.max_tokens} completion) but no replica of this deployment can hold it (the largest KV pool "
            f"of a replica {SIDE_WORDS[exc.side]} holds {exc.largest_pool:.0f} tokens). Please reduce {fix}.",
            param=prompt_param if exc.prompt_alone else "max_tokens")
    return InvalidRequest(f"{prompt_param}: {exc}", param=prompt_param)  # an empty prompt, ids off the vocabulary


class PayloadTooLarge(APIError):
    status, type, code = 413, "invalid_request_error", "request_too_large"


class Unauthorized(APIError):
    """OpenAI's answer to a missing or wrong key; the message never repeats what the client sent."""
    status, type, code = 401, "invalid_request_error", "invalid_api_key"

    def __init__(self, message: str):
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})


class ModelNotFound(APIError):
    status, type, code = 404, "invalid_request_error", "model_not_found"


class NotFound(APIError):
    status, type, code = 404, "invalid_request_error", "not_found"


class MethodNotAllowed(APIError):
    status, type, code = 405, "invalid_request_error", "method_not_allowed"


class Overloaded(APIError):
    status, type, code = 503, "server_error", "overloaded"


class ShuttingDown(Overloaded):
    """A request the server's graceful shutdown refused or ended (``serve.server``'s drain): another
    instance, or this one restarted, can serve it, so ``Retry-After`` says when to try again. Clients
    retry on the status (the OpenAI SDK: any 5xx, after ``Retry-After``), never on the code: the code
    says why to the one reading it."""
    code = "shutting_down"
    RETRY_AFTER_S = 5

    def __init__(self, message: str = "the server is shutting down; retry on another instance or later"):
        super().__init__(message, headers={"Retry-After": str(self.RETRY_AFTER_S)})


class Unavailable(Overloaded):
    """No live replica can serve. Where a lost replica may come back (an operator's re-plan) it says
    when to retry, and clients that honour ``Retry-After`` wait instead of failing at once; where
    only a restart brings the server back (``comes_back`` False) it does not invite retries."""
    code = "unavailable"
    RETRY_AFTER_S = 5

    def __init__(self, message: str, param: str | None = None, comes_back: bool = True):
        super().__init__(message, param, headers={"Retry-After": str(self.RETRY_AFTER_S)} if comes_back else None)


class ServerError(APIError):
    status, type = 500, "server_error"


def to_api_error(exc: BaseException) -> APIError:
    """The most specific ``APIError`` for any exception (the single mapping used everywhere)."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    from hetserve.errors import HetserveError, InfeasibleError

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestValidationError):
        return _validation_error(exc.errors())
    if isinstance(exc, HTTPException):
        if exc.status_code == 404:
            return NotFound(str(exc.detail))
        if exc.status_code == 405:
            return MethodNotAllowed(str(exc.detail))
        if 400 <= exc.status_code < 500:
            err = InvalidRequest(str(exc.detail))
            err.status = exc.status_code
            return err
        return ServerError(str(exc.detail))
    if isinstance(exc, InfeasibleError):
        return InvalidRequest(str(exc))
    if isinstance(exc, HetserveError):
        return ServerError(str(exc))
    return ServerError(f"internal error: {type(exc).__name__}: {exc}")


def _validation_error(errors: list[dict[str, Any]]) -> InvalidRequest:
    """One readable line from pydantic's error list; ``param`` is the first offending field."""
    if not errors:
        return InvalidRequest("invalid request body")
    first = errors[0]
    loc = _where(first)
    kind = first.get("type", "")
    if kind in ("json_invalid", "json_type"):
        return InvalidRequest("request body is not valid JSON: " + str(first.get("msg", "")))
    if kind == "missing" and not loc:
        return InvalidRequest("request body is missing (expected a JSON object)")
    field, members = _union_members(errors, loc)
    if members:  # a value matching no member of a union: one line naming them, not one per member
        rest = sum(1 for e in errors if _where(e)[:len(field)] != field)
        got = repr(first.get("input"))
        text = (f"{'.'.join(field)}: must be {', '.join(members[:-1])} or {members[-1]}; got "
                f"{got if len(got) <= 60 else got[:57] + '...'}")
        if rest:
            text += f" (and {rest} more problem{'s' if rest > 1 else ''})"
        return InvalidRequest(text, param=".".join(field))
    msg = str(first.get("msg", "invalid value"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if kind == "extra_forbidden":
        msg = "unrecognized request argument supplied"
    param = ".".join(loc) if loc else None
    if param is None and ": " in msg:  # a model-level check names its field first ("n: only n=1 ...")
        head = msg.split(": ", 1)[0]
        param = head.split(" / ")[0] if head.replace("_", "").replace(" / ", "").isalnum() else None
    text = f"{param}: {msg}" if param and not msg.startswith(param.split(".")[0] + ":") else msg
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return InvalidRequest(text, param=param)


def _where(error: dict[str, Any]) -> list[str]:
    """A pydantic error's location in the request body: its field path, ``body`` left out."""
    return [str(p) for p in error.get("loc", ()) if p != "body"]


def _union_members(errors: list[dict[str, Any]], loc: list[str]) -> tuple[list[str], list[str]]:
    """(the union field the first error's value matched no member of, those members): pydantic
    reports one error per member, each located under the member's name after the field's
    (``prompt.str``, ``prompt.list[int].0``, ``messages.0.content.str``). ([], []) for other errors."""
    at = next((i for i, p in enumerate(loc) if i and _names_a_type(p)), None)
    if at is None:
        return [], []
    field, members = loc[:at], []
    for e in errors:
        where = _where(e)
        if where[:at] == field and len(where) > at and _names_a_type(where[at]) and where[at] not in members:
            members.append(where[at])
    return (field, members) if len(members) > 1 else ([], [])


def _names_a_type(part: str) -> bool:
    """A member is named by its type (``str``, ``list[int]``, a model's class); an object's own
    fields (``response_format.type``) and list positions are not."""
    return "[" in part or part in _TYPE_NAMES or part[:1].isupper()


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


def _naming(what: str) -> str:
    """``what`` with the request's id (``x-request-id``, ``request_ids``), which the client can quote."""
    rid = current_request_id()
    return f"{what} [{rid}]" if rid else what


def error_response(exc: BaseException, path: str = ""):
    from fastapi.responses import JSONResponse

    err = to_api_error(exc)
    where = _naming(path or "request")
    if isinstance(err, Overloaded):  # a refusal the server chose (draining, no live replica): no fault
        log.warning("%s %d %s: %s", where, err.status, err.code, err.message)
    elif err.status >= 500:
        log.error("%s failed: %s", where, err.message, exc_info=exc if exc is not err else None)
    else:
        log.warning("%s %d %s (param=%s): %s", where, err.status, err.code or err.type, err.param, err.message)
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


STREAM_END = "data: [DONE]\n\n"  # an SSE stream's last event, after its answer or its error event (OpenAI's)


def error_event(exc: BaseException) -> str:
    """The SSE event that ends a stream which failed after its headers were sent."""
    err = to_api_error(exc)
    where = _naming("stream")
    if isinstance(err, Overloaded):  # as in error_response: a refusal, not a fault
        log.warning("%s ended: %d %s: %s", where, err.status, err.code, err.message)
    elif err.status >= 500:
        log.error("%s failed: %s", where, err.message, exc_info=exc if exc is not err else None)
    return f"data: {json.dumps(err.body())}\n\n"


def install_error_handlers(app, on_error=None) -> None:
    """Route every exception a request can raise through ``error_response``; ``on_error(path, APIError)``
    (optional) sees each one first (the server counts client errors with it)."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    async def handler(request, exc):
        if on_error is not None:
            on_error(request.url.path, to_api_error(exc))
        return error_response(exc, request.url.path)

    for cls in (APIError, RequestValidationError, HTTPException, Exception):
        app.add_exception_handler(cls, handler)
