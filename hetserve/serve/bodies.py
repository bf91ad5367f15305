"""Request bodies as both HTTP fronts read them (``hetserve serve``'s ``serve.app`` and ``hetserve
route``'s ``route.server``), so that one bad body gets one answer from either: the bytes, refused
(413) as soon as they are known to be over the limit, and the JSON object in them, refused (400)
saying why: not UTF-8, not JSON, a lone surrogate, nested too deeply, an integer too long to read,
not an object, or fields the request model refuses."""

from __future__ import annotations

import json

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.requests import ClientDisconnect, Request

from hetserve.serve.errors import InvalidRequest, PayloadTooLarge


class ClientGone(Exception):
    """The client closed its connection before its request was read: nobody to answer."""


async def read_bytes(request: Request, max_bytes: int) -> bytes:
    """The body, refused (413) as soon as it is known to be over ``max_bytes``: by its
    Content-Length before a byte is read, else by counting as it arrives (chunked uploads)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
        raise PayloadTooLarge(f"request body is {int(declared)} bytes; this server takes at most {max_bytes}")
    parts, size = [], 0
    try:
        async for part in request.stream():
            size += len(part)
            if size > max_bytes:
                raise PayloadTooLarge(f"request body is over {max_bytes} bytes, the most this server takes")
            parts.append(part)
    except ClientDisconnect as exc:
        raise ClientGone() from exc
    return b"".join(parts)


def json_object(raw: bytes, empty: dict | None = None) -> dict:
    """The JSON object of a body; ``empty``: what a blank body stands for (None: it is refused)."""
    if not raw.strip() and empty is not None:
        return dict(empty)
    try:
        data = _json_of(raw) if raw else None
        # a lone surrogate ("\ud800") is valid JSON but no text: refuse it here, not in the tokenizer
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    except UnicodeEncodeError as exc:
        raise InvalidRequest(f"request body: strings must be valid Unicode text ({exc.reason} at "
                             f"{exc.object[exc.start:exc.end]!r})") from exc
    except RecursionError as exc:
        raise InvalidRequest("request body is nested too deeply") from exc
    except ValueError as exc:
        # an integer literal of over 4,300 digits: Python refuses to convert it (a guard against
        # quadratic-time parsing), a ValueError json.loads lets through; a client error, not a fault
        raise InvalidRequest(f"request body: {exc}".split(";")[0]) from exc
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    return data


def validated(model, data: dict):
    """``data`` as the request ``model`` (a pydantic model) takes it; its refusals as FastAPI's 400s."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from exc
    except RecursionError as exc:
        raise InvalidRequest("request body is nested too deeply") from exc


def _json_of(raw: bytes):
    """The JSON document of a request body, read as UTF-8, the only encoding JSON over HTTP may use
    (RFC 8259): ``json.loads`` on bytes would guess UTF-16 or -32 from the first bytes and fail with
    that codec's name in the message. Raises ``json.JSONDecodeError``."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise json.JSONDecodeError(f"not UTF-8 text (byte 0x{raw[exc.start]:02x})", "", exc.start) from exc
    return json.loads(text)
