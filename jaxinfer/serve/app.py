"""The OpenAI-compatible HTTP API over an `EngineLoop`: FastAPI routes, OpenAI-shaped errors.

    POST /v1/completions        text or token-id prompts (one or a list), n, best_of, logprobs
    POST /v1/chat/completions   messages under the model's chat template
    GET  /v1/models             the one model served
    GET  /health                200 while the engine thread runs, else 503 with the reason
    GET  /metrics               Prometheus text (serve/metrics.py)

Errors are `{"error": {"message", "type", "param", "code"}}`: 400 for a bad request (the
message names the field, and for a prompt over the context both lengths), 404 for a model not
served, 413 for a body over `max_body_bytes`, 429 with `Retry-After` when the queue is full,
503 when the engine thread has stopped. A bad request never reaches the engine's step; a
request the engine refuses at `add_request` fails alone. A client that disconnects (streaming
or not) has its request aborted: its pages are freed at once (`Engine.abort`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxinfer.engine.llm import LLM, RequestOutput
from jaxinfer.serve.engine_loop import EngineDead, EngineLoop, QueueFull, Submission, TokenEvent
from jaxinfer.serve.metrics import ServerMetrics
from jaxinfer.serve.protocol import ChatCompletionRequest, CompletionRequest, api_message
from jaxinfer.serve.text import StreamedText

RETRY_AFTER_S = 1  # what a 429 asks a client to wait


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def _error_body(status: int, message: str, param: str | None = None,
                kind: str = "invalid_request_error") -> dict:  # fmt: skip
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(e: APIError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 429 else None
    return JSONResponse(_error_body(e.status, e.message, e.param, e.kind), e.status,
                        headers=headers)  # fmt: skip


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One message for pydantic's errors (a union reports one per member: the field once)."""
    parts, fields = [], []
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        kind = err.get("type")
        if kind == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", err.get("msg"))
            return f"the request body is not valid JSON: {detail}", None
        if not loc:
            return "the request body must be a JSON object", None
        field = loc[0]
        if field in fields:
            continue
        fields.append(field)
        where = ".".join(loc if kind != "extra_forbidden" else loc[:1])
        if kind == "missing":
            parts.append(f"{where}: required field missing")
        elif kind == "extra_forbidden":
            parts.append(f"{where}: unknown field (not supported by this server)")
        else:
            parts.append(f"{where}: {err.get('msg')} (got {err.get('input')!r:.60})")
    return "; ".join(parts), (fields[0] if fields else None)


SHUTDOWN = object()  # put in a stream's queue: the server is stopping


@dataclass
class ServeState:
    llm: LLM
    model_name: str
    max_queue: int
    engine_loop: EngineLoop | None = None
    metrics: ServerMetrics | None = None
    streams: set[asyncio.Queue] = field(default_factory=set)  # the open streams' event queues

    def end_streams(self) -> int:
        """Shutdown: each open stream sends an error event and [DONE] and ends; how many."""
        for q in self.streams:
            q.put_nowait(SHUTDOWN)
        return len(self.streams)

    @property
    def max_model_len(self) -> int:
        return self.llm.config.max_model_len


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` is answered 413 (by its Content-Length,
    or while it is read when it has none) and never buffered whole."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._too_large(send, int(length))
        state = {"received": 0, "answered": False}

        async def limited_receive():
            message = await receive()
            if message["type"] == "http.request":
                state["received"] += len(message.get("body", b""))
                if state["received"] > self.max_bytes and not state["answered"]:
                    state["answered"] = True
                    await self._too_large(send, None)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message):
            if not state["answered"]:
                await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not state["answered"]:
                raise

    async def _too_large(self, send, length: int | None) -> None:
        size = f"{length} bytes" if length is not None else "more"
        body = json.dumps(_error_body(413, f"the request body is {size}, over the server's "
                                           f"limit of {self.max_bytes} bytes")).encode()  # fmt: skip
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})


def create_app(state: ServeState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.metrics = ServerMetrics()
        state.engine_loop = EngineLoop(state.llm.engine, asyncio.get_running_loop(),
                                       state.metrics, state.max_queue)  # fmt: skip
        state.engine_loop.start()
        try:
            yield
        finally:
            state.engine_loop.close()

    app = FastAPI(title="jaxinfer", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.serve = state
    api = _Handlers(state)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        message, param = validation_message(e.errors())
        return error_response(APIError(400, message, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        return error_response(APIError(e.status_code, str(e.detail), kind="not_found_error"
                                       if e.status_code == 404 else "invalid_request_error"))  # fmt: skip

    @app.get("/health")
    async def health():
        loop = state.engine_loop
        if loop is None or not loop.alive:
            why = (loop.error if loop is not None else None) or "the engine is not running"
            return JSONResponse({"status": "error", "error": why}, 503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(state.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        cfg = state.llm.engine.model_config
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "jaxinfer", "max_model_len": state.max_model_len,
            "vocab_size": cfg.vocab_size,
        }]}  # fmt: skip

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await api.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await api.chat(body, request)

    return app


async def _until_disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is read by now: what comes next is that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class _Handlers:
    """The two generation endpoints; everything model-specific comes from `state.llm`."""

    def __init__(self, state: ServeState) -> None:
        self.state = state
        self.tokenizer = state.llm.tokenizer

    # -- shared --------------------------------------------------------------------------------
    def _check_model(self, model: str) -> None:
        if model != self.state.model_name:
            raise APIError(404, f"model {model!r} is not served here: this server serves "
                                f"{self.state.model_name!r} (GET /v1/models)", "model",
                           "not_found_error")  # fmt: skip

    def _encode(self, prompt, name: str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(400, f"{name}: model {self.state.model_name!r} has no tokenizer: "
                                    "send the prompt as a list of token ids", name)  # fmt: skip
            return list(self.tokenizer.encode(prompt).ids)
        return list(prompt)

    def _check_length(self, ids: list[int], max_tokens: int, name: str, key: str) -> None:
        limit = self.state.max_model_len
        if not ids:
            raise APIError(400, f"{name} is empty", name)
        if len(ids) >= limit:
            raise APIError(400, f"{name} has {len(ids)} tokens, but this model's context is "
                                f"{limit} tokens (engine.max_model_len): shorten it", name)  # fmt: skip
        if len(ids) + max_tokens > limit:
            raise APIError(400, f"{name} has {len(ids)} tokens and {key} is {max_tokens}: "
                                f"{len(ids) + max_tokens} tokens exceed this model's context of "
                                f"{limit} tokens (engine.max_model_len); lower {key} to at most "
                                f"{limit - len(ids)}", key)  # fmt: skip

    async def _submit(self, prompts: list[list[int]], sampling, stream: bool) -> list[Submission]:
        loop = self.state.engine_loop
        try:
            subs = loop.submit(prompts, sampling, stream=stream)
        except QueueFull as e:
            raise APIError(429, f"the server is at capacity ({e}): retry after "
                                f"{RETRY_AFTER_S} s", kind="rate_limit_error") from None  # fmt: skip
        except EngineDead as e:
            raise APIError(503, f"the engine has stopped: {str(e).strip().splitlines()[-1]}",
                           kind="server_error") from None  # fmt: skip
        errors = await asyncio.gather(*(s.accepted for s in subs))
        refused = [(s, err) for s, err in zip(subs, errors, strict=True) if err is not None]
        if refused:
            loop.abort(subs)
            sub, err = refused[0]
            message = api_message(err)
            field = re.match(r"(\w+)=", message)  # (a sampling field: the engine names it)
            if field is None:  # about the prompt, or the engine's options
                name = "prompt" if len(subs) == 1 else f"prompt[{sub.tag}]"
                raise APIError(400, f"{name}: {message}", name)
            raise APIError(400, message, field.group(1))
        return subs

    async def _outputs(self, subs: list[Submission], request: Request) -> list[RequestOutput]:
        """The final outputs, or an abort when the client leaves first."""
        finals = asyncio.gather(*(s.final for s in subs))
        gone = asyncio.ensure_future(_until_disconnected(request))
        try:
            await asyncio.wait({finals, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not finals.done():
                self.state.engine_loop.abort(subs)
        if not finals.done():
            raise APIError(499, "client disconnected")
        outputs = finals.result()
        for out in outputs:
            if out is None:
                raise APIError(503, "the engine stopped while serving this request",
                               kind="server_error")  # fmt: skip
            if out.error is not None:
                raise APIError(500, f"the engine failed this request: {out.error}",
                               kind="server_error")  # fmt: skip
        return outputs

    def _token_str(self, t: int) -> str:
        return self.tokenizer.decode([t]) if self.tokenizer is not None else f"token_id:{t}"

    def _top(self, entry: dict, k: int) -> list[tuple[str, float]]:
        ranked = sorted(entry["top"].items(), key=lambda kv: -kv[1])[:k]
        return [(self._token_str(t), float(v)) for t, v in ranked]

    def _completion_logprobs(self, entries: list[dict], k: int, offset: int) -> dict:
        tokens = [self._token_str(e["token"]) for e in entries]
        offsets = []
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        return {"tokens": tokens, "token_logprobs": [float(e["logprob"]) for e in entries],
                "top_logprobs": [dict(self._top(e, k)) for e in entries],
                "text_offset": offsets}  # fmt: skip

    def _chat_logprobs(self, entries: list[dict], k: int) -> dict:
        def item(tok: str, lp: float) -> dict:
            return {"token": tok, "logprob": lp, "bytes": list(tok.encode())}

        content = [{**item(self._token_str(e["token"]), float(e["logprob"])),
                    "top_logprobs": [item(t, v) for t, v in self._top(e, k)]} for e in entries]  # fmt: skip
        return {"content": content, "refusal": None}

    @staticmethod
    def _usage(prompts: list[list[int]], completion_tokens: int) -> dict:
        p = sum(len(ids) for ids in prompts)
        return {"prompt_tokens": p, "completion_tokens": completion_tokens,
                "total_tokens": p + completion_tokens}  # fmt: skip

    # -- /v1/completions ------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request):
        self._check_model(body.model)
        if body.best_of is not None and body.stream:
            raise APIError(400, "best_of cannot be streamed (stream: true)", "best_of")
        raw = body.prompts()
        if not raw:
            raise APIError(400, "prompt is an empty list", "prompt")
        names = ["prompt"] if len(raw) == 1 else [f"prompt[{i}]" for i in range(len(raw))]
        prompts = [self._encode(p, n) for p, n in zip(raw, names, strict=True)]
        sampling = self._sampling(body, body.max_tokens, body.logprobs, body.best_of)
        for ids, name in zip(prompts, names, strict=True):
            self._check_length(ids, sampling.max_tokens, name, "max_tokens")
        subs = await self._submit(prompts, sampling, body.stream)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return self._stream(subs, prompts, body, rid, created, chat=False)
        outputs = await self._outputs(subs, request)
        choices, n_out = [], 0
        for sub, out in zip(subs, outputs, strict=True):
            for j, c in enumerate(out.outputs):
                n_out += len(c.token_ids)
                choice = {"index": sub.tag * sampling.n + j, "text": c.text or "",
                          "logprobs": None, "finish_reason": c.finish_reason}  # fmt: skip
                if body.logprobs is not None:
                    choice["logprobs"] = self._completion_logprobs(c.logprobs, body.logprobs, 0)
                if body.return_token_ids:
                    choice["token_ids"] = c.token_ids
                choices.append(choice)
        return {"id": rid, "object": "text_completion", "created": created,
                "model": self.state.model_name, "choices": choices,
                "usage": self._usage(prompts, n_out)}  # fmt: skip

    def _sampling(self, body, max_tokens: int, logprobs: int | None, best_of: int | None = None):
        try:
            sampling = body.sampling(max_tokens, logprobs, best_of)
            # n / best_of beyond the engine's sequences: 400 here, before the capacity check
            # (a busy server would answer 429, and retrying never helps)
            sampling.validate(max_num_seqs=self.state.llm.config.max_num_seqs)
            return sampling
        except ValueError as e:
            message = api_message(str(e))
            field = message.split("=", 1)[0].split(":", 1)[0].strip()
            raise APIError(400, message, field) from None

    # -- /v1/chat/completions -------------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest, request: Request):
        self._check_model(body.model)
        try:
            logprobs, max_tokens = body.num_logprobs(), body.requested_max_tokens()
            text = self.state.llm.render_chat([m.as_dict() for m in body.messages])
        except ValueError as e:
            raise APIError(400, f"messages: {e}" if "template" in str(e) or "messages" in str(e)
                           else str(e), "messages") from None  # fmt: skip
        ids = self._encode(text, "messages")
        key = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        if max_tokens is None:  # the rest of the context, as vLLM
            max_tokens = max(1, self.state.max_model_len - len(ids))
        self._check_length(ids, max_tokens, "messages (rendered by the chat template)", key)
        sampling = self._sampling(body, max_tokens, logprobs)
        subs = await self._submit([ids], sampling, body.stream)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return self._stream(subs, [ids], body, rid, created, chat=True)
        (out,) = await self._outputs(subs, request)
        choices = []
        for j, c in enumerate(out.outputs):
            choice = {"index": j, "message": {"role": "assistant", "content": c.text or ""},
                      "logprobs": None, "finish_reason": c.finish_reason}  # fmt: skip
            if logprobs is not None:
                choice["logprobs"] = self._chat_logprobs(c.logprobs, logprobs)
            if body.return_token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        n_out = sum(len(c.token_ids) for c in out.outputs)
        return {"id": rid, "object": "chat.completion", "created": created,
                "model": self.state.model_name, "choices": choices,
                "usage": self._usage([ids], n_out)}  # fmt: skip

    # -- streaming ------------------------------------------------------------------------------
    def _stream(self, subs, prompts, body, rid, created, *, chat: bool) -> StreamingResponse:
        n = subs[0].sampling.n
        k = subs[0].sampling.logprobs
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": rid, "object": obj, "created": created, "model": self.state.model_name}
        loop = self.state.engine_loop

        def chunk(choices: list[dict]) -> str:
            return _sse({**head, "choices": choices, **({"usage": None} if include_usage else {})})

        async def events():
            texts = {(s.tag, i): StreamedText(self.tokenizer, s.sampling.stop)
                     for s in subs for i in range(n)}  # fmt: skip
            offsets = dict.fromkeys(texts, 0)
            ended, n_out = 0, 0
            queue = subs[0].events
            self.state.streams.add(queue)
            try:
                if chat:
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None} for i in range(n)])  # fmt: skip
                while ended < len(subs):
                    ev = await queue.get()
                    if ev is SHUTDOWN:
                        yield _sse(_error_body(503, "the server is shutting down",
                                               kind="server_error"))  # fmt: skip
                        break
                    if isinstance(ev, Submission):  # that prompt is done
                        ended += 1
                        out = ev.final.result()
                        if out is None or out.error is not None:
                            why = "the engine stopped" if out is None else out.error
                            yield _sse(_error_body(500, f"the engine failed this request: {why}",
                                                   kind="server_error"))  # fmt: skip
                            loop.abort(subs)
                            break
                        n_out += sum(len(c.token_ids) for c in out.outputs)
                        continue
                    yield self._event_chunk(ev, texts, offsets, n, k, body, chat, chunk)
                else:
                    if include_usage:
                        yield _sse({**head, "choices": [], "usage": self._usage(prompts, n_out)})
                yield _sse("[DONE]")
            finally:  # (a client that left: the response task is cancelled here)
                self.state.streams.discard(queue)
                loop.abort(subs)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})  # fmt: skip

    def _event_chunk(self, ev: TokenEvent, texts, offsets, n, k, body, chat, chunk) -> str:
        key = (ev.sub.tag, ev.index)
        if ev.finished:
            text = texts[key].finish(ev.token_ids, ev.text)
        else:
            text = texts[key].add(ev.token_ids)
        choice: dict = {"index": ev.sub.tag * n + ev.index}
        if chat:
            choice["delta"] = {"content": text} if text or not ev.finished else {}
        else:
            choice["text"] = text
        choice["logprobs"] = None
        if k is not None and ev.logprobs:
            if chat:
                choice["logprobs"] = self._chat_logprobs(ev.logprobs, k)
            else:
                choice["logprobs"] = self._completion_logprobs(ev.logprobs, k, offsets[key])
                offsets[key] += sum(len(t) for t in choice["logprobs"]["tokens"])
        choice["finish_reason"] = ev.finish_reason if ev.finished else None
        if body.return_token_ids:
            choice["token_ids"] = ev.token_ids
        return chunk([choice])
