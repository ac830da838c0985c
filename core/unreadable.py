"""Bytes that are no message of the method's type: refused with INVALID_ARGUMENT, not UNKNOWN.

grpcio parses a request before the method runs, and a parse error ends the call with UNKNOWN
("Unexpected DecodeError"), as a bug of ours would. Every server of ours is made with
`Refuse()` among its interceptors: a request that does not parse becomes an `Unreadable`, and
the call is ended with INVALID_ARGUMENT naming the type, before the method reads it (unary
requests) or when it reaches it (streams, whose methods iterate over them). A method that reads
its stream with `context.read()` (the agent's Generate, on the data path) checks `unreadable`
itself.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError


@dataclass(frozen=True, slots=True)
class Unreadable:
    type_name: str

    @property
    def reason(self) -> str:
        return f"the request is not a valid {self.type_name} message"


def unreadable(message: object) -> bool:
    return isinstance(message, Unreadable)


async def abort(context: grpc.aio.ServicerContext, message: Unreadable) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message.reason)


def _tolerant(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    name = getattr(getattr(parse, "__self__", None), "DESCRIPTOR", None)
    type_name = name.full_name if name is not None else "request"

    def read(raw: bytes) -> Any:
        try:
            return parse(raw)
        except DecodeError:
            return Unreadable(type_name)

    return read


def _checked_unary(behavior: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):

        async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if unreadable(request):
                await abort(context, request)
            async for reply in behavior(request, context):
                yield reply

        return streaming

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if unreadable(request):
            await abort(context, request)
        return await behavior(request, context)

    return unary


def _checked_stream(behavior: Callable[..., Any]) -> Callable[..., Any]:
    async def requests(iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for message in iterator:
            if unreadable(message):
                await abort(context, message)
            yield message

    if inspect.isasyncgenfunction(behavior):

        async def streaming(iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for reply in behavior(requests(iterator, context), context):
                yield reply

        return streaming

    async def unary(iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        return await behavior(requests(iterator, context), context)

    return unary


_MAKERS = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler, _checked_unary),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler, _checked_unary),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler, _checked_stream),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler, _checked_stream),
}


class Refuse(grpc.aio.ServerInterceptor):
    """Makes every method's request parsing tolerant, and its behaviour refuse what did not parse."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        kind, make, check = _MAKERS[(handler.request_streaming, handler.response_streaming)]
        return make(
            check(getattr(handler, kind)),
            request_deserializer=_tolerant(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )
