"""What a stranger who can reach the port is allowed to make ``cbpause serve`` do and hold (issue 39).

:class:`Guard` is a pure ASGI middleware in front of every route (transformers' OpenAI routes and the control
routes alike), so that no route can forget a rule:

* **Authentication.** With an API key (``--api-key`` or ``CBPAUSE_API_KEY``), every route but ``GET /health`` needs
  ``Authorization: Bearer KEY``; anything else is a ``401`` and reaches no route (vLLM's ``--api-key`` does the same).
  The key is compared in constant time.
* **Body size.** A body longer than ``max_body_bytes`` is a ``413``, refused from its ``Content-Length`` before a
  byte is read, or as soon as a chunked body passes the limit: the server never holds more than that per request.
* **JSON.** A ``POST`` body declared JSON (or with no ``Content-Type``) that is not JSON a route can read
  (malformed, an integer too long for Python to parse, nesting too deep, a top level that is not an object) is a
  ``400`` before any route sees it, so that no route's own parser ends in a ``500``.  So is a string that is not
  valid Unicode (a lone surrogate, ``"\\ud800"``, which JSON can carry and UTF-8 cannot): a route that stored one (a
  weight version, a holder's name) could no longer answer anything that names it.  The body, read once, is handed
  on to the route unchanged.

Decisions (``docs/serving.md``): the limits hold for every route; ``/health`` stays open, since a load balancer's
probe carries no key and the answer says nothing a stranger can use.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

__all__ = ["Guard", "MAX_BODY_BYTES", "OPEN_PATHS", "parse_json_object"]

MAX_BODY_BYTES = 4 * 1024 * 1024  # a prompt of a long context is a few hundred kB; a control body, a few hundred bytes
OPEN_PATHS = frozenset({"/health"})


class BadJSON(ValueError):
    """A body that is not a JSON object a route can read (a 400)."""


def parse_json_object(raw: bytes) -> dict | None:
    """The JSON object in ``raw``; ``None`` for an empty body; :class:`BadJSON` for anything else a route cannot
    read: bytes that are not UTF-8 or not JSON, nesting deeper than the parser recurses (``RecursionError``), an
    integer of more digits than Python parses (``int_max_str_digits``), a top level that is not an object, a string
    (a key or a value) that is not valid Unicode."""
    if not raw.strip():
        return None
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:  # JSONDecodeError, too many digits
        raise BadJSON(f"malformed JSON: {error}") from None
    if not isinstance(body, dict):
        raise BadJSON(f"the body must be a JSON object, not {type(body).__name__}")
    if b"\\u" in raw and (where := _lone_surrogate(body, "")) is not None:  # only an escape can carry one
        raise BadJSON(f"{where or 'a key'}: not valid Unicode (a lone surrogate)")
    return body


def _valid(text: str) -> bool:
    """Whether ``text`` is valid Unicode (JSON may carry a lone surrogate, ``"\\ud800"``, which UTF-8 cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The path of a string in ``value`` that is not valid Unicode (``messages[0].content``), or None.  An
    explicit stack, not recursion: the parser took the nesting, but the body may sit near the recursion limit."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if not _valid(item):
                return where
        elif isinstance(item, dict):
            for key, inner in item.items():
                name = f"{where}.{key}" if where else key
                if not _valid(key):
                    return where or "a key"
                stack.append((inner, name))
        elif isinstance(item, list):
            stack.extend((inner, f"{where}[{i}]") for i, inner in enumerate(item))
    return None


class Guard:
    """Pure ASGI middleware: authentication, body size and JSON checks in front of every HTTP route (see above)."""

    def __init__(self, app: Any, *, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        if api_key is not None and (not isinstance(api_key, str) or not api_key.strip()):
            raise ValueError("an API key must be a non-empty string")
        if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be an integer of at least 1024, not {max_body_bytes!r}")
        self.app = app
        self._expected = None if api_key is None else f"Bearer {api_key}".encode()
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        openai = str(scope.get("path", "")).startswith("/v1/")

        async def refuse(status: int, message: str, extra: list[tuple[bytes, bytes]] | None = None) -> None:
            await _answer(send, status, message, extra, openai=openai)

        if self._expected is not None and scope.get("path") not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                await refuse(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                              [(b"www-authenticate", b"Bearer")])  # fmt: skip
                return
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await refuse(400, f"bad Content-Length {length[:40]!r}")
                return
            if declared > self.max_body_bytes:
                limit = self.max_body_bytes
                await refuse(413, f"the body is {declared} bytes; this server takes {limit} at most")
                return
        if scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before its body was in: nothing to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await refuse(413, f"the body passed {self.max_body_bytes} bytes, the most this server takes")
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        raw = b"".join(chunks)
        kind = headers.get(b"content-type", b"application/json").lower()
        try:
            if b"json" in kind:
                parse_json_object(raw)
        except BadJSON as error:
            await refuse(400, str(error))
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)


async def _answer(send: Any, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None,
                  openai: bool = False) -> None:  # fmt: skip
    """A refusal: ``{"error": message}`` as the control routes answer, or OpenAI's error object on its routes."""
    error: Any = message
    if openai:
        error = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    body = json.dumps({"error": error}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})
