"""Small HTTP pieces both of the emulator's APIs use: JSON and SSE replies, errors."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from nodes.emulator.params import BodyError, decode_json
from nodes.emulator.worker import EmulatedWorker

WORKER_KEY = web.AppKey("worker", EmulatedWorker)
SSE_DONE = b"data: [DONE]\n\n"


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def openai_error(message: str, *, status: int = 400, err_type: str = "BadRequestError") -> web.Response:
    """SGLang's flat ErrorResponse, used by its OpenAI routes and FastAPI validation."""
    body = {"object": "error", "message": message, "type": err_type, "param": None, "code": status}
    return json_response(body, status)


def sse(event: Any) -> bytes:
    return b"data: " + orjson.dumps(event) + b"\n\n"


async def read_json_object(request: web.Request) -> dict[str, Any]:
    body = decode_json(await request.read())
    if not isinstance(body, dict):
        raise BodyError(
            f"[{{'type': 'dict_type', 'loc': ('body',), 'msg': 'Input should be a valid dictionary', 'input': {body!r}}}]"
        )
    return body


async def start_sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response


async def sse_reply(request: web.Request, events: list[bytes]) -> web.StreamResponse:
    response = await start_sse(request)
    for event in events:
        await response.write(event)
    return response
