"""API server: ``vllm.entrypoints.serve.register_vllm_serve_api_routers`` (which vLLM's
``build_app`` calls on its FastAPI app, also when the server runs as ``python -m
vllm.entrypoints.openai.api_server``) is wrapped so that the app also serves the routes of apps
on a running server (checks and bookkeeping:
:mod:`vllm_xmix.validation.admin`; worker side: :mod:`vllm_xmix.runtime.updates`):

* ``GET /v1/mi/apps``: the apps requests can select (open, unless vLLM's ``--api-key`` guards
  every ``/v1`` route, as for vLLM's own routes);
* ``POST /v1/mi/apps/{name}``: replace a deployed app's parameters;
* ``POST /v1/mi/apps``: add an app into capacity the deployment reserved.

and so that a request selecting apps on a route apps do not apply to is an HTTP 400 instead of
running without them (:class:`SelectionRouteGuard`).

The changing routes need a key (:func:`vllm_xmix.validation.admin.check_key`), are applied one at
a time, and reach the workers through ``EngineClient.collective_rpc("xmix_admin", ...)``; the
front end's request checks switch to the new apps once every worker applied the change."""

# (no "from __future__ import annotations": FastAPI reads the routes' annotations, Request)
import asyncio
import functools
import logging

from ..validation.admin import AdminError, check_content_type, check_key, commit_change, list_apps, parse_body, \
    prepare_change
from ..validation.http import ADMIN_PREFIX, SELECTION_ROUTES, error_param, on_route_error, selection_off_route
from .core import mark
from .output_processor import live_versions

logger = logging.getLogger("vllm.xmix")

_STATUS_TYPE = {400: "BadRequestError", 401: "Unauthorized", 403: "Forbidden", 404: "NotFoundError",
                409: "ConflictError", 422: "UnprocessableEntityError", 501: "NotImplementedError",
                507: "InsufficientStorageError", 500: "InternalServerError"}


def patch_api_server() -> None:
    try:
        import vllm.entrypoints.serve as serve
    except Exception as e:  # the server is optional
        logger.debug("vllm_xmix: vLLM's API server not importable (%s)", e)
        return

    def wrap(orig):
        @functools.wraps(orig)
        def register_vllm_serve_api_routers(app, *a, **kw):
            out = orig(app, *a, **kw)
            add_app_routes(app)
            app.add_middleware(SelectionRouteGuard)
            return out

        return register_vllm_serve_api_routers

    mark("register_vllm_serve_api_routers", serve, "register_vllm_serve_api_routers", wrap)


class SelectionRouteGuard:
    """ASGI middleware on vLLM's API server: a JSON ``POST`` that selects apps (``mi_apps``,
    ``vllm_xargs.xmix``) on a route other than ``/v1/completions`` and ``/v1/chat/completions``
    (``/v1/responses``, ``/v1/messages``, ``/v1/chat/completions/batch``,
    ``/inference/v1/generate``, ...) is answered with HTTP 400 naming the field and the route:
    those routes would run the request without the apps, or without returning read values. On
    the two routes apps apply to, a ``vllm_xargs.xmix`` of a type vLLM's request model rejects (an
    object) gets a 400 that says how to send it, instead of vLLM's validation dump, and so does
    an ``xmix`` / ``mi_apps`` key the server would not read (``extra_args.xmix``,
    ``kv_transfer_params.xmix``, a misspelled ``vllm_xargs``). The body is
    read whole and handed on unchanged; other methods, content types and the ``/v1/mi/`` routes
    pass through untouched."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        path = scope.get("path") or ""
        if path.startswith(ADMIN_PREFIX):
            return await self.app(scope, receive, send)
        ctype = next((v for k, v in scope.get("headers") or () if k == b"content-type"), b"")
        if b"json" not in ctype.lower():
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":  # the client went away: nothing to answer
                return
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        body = b"".join(chunks)
        on_route = path.rstrip("/") in SELECTION_ROUTES
        err = on_route_error(body) if on_route else selection_off_route(path, body)
        if err is not None:
            return await _error(400, err)(scope, receive, send)
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


def _error(status: int, message: str):
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": _STATUS_TYPE.get(status, "Error"), "param": error_param(message),
        "code": status}})


def add_app_routes(app) -> None:
    """The ``/v1/mi/apps`` routes on vLLM's FastAPI ``app``."""
    from fastapi import Request
    from fastapi.responses import JSONResponse, Response
    from starlette.requests import ClientDisconnect

    lock = asyncio.Lock()

    def _config(request: Request):
        client = getattr(request.app.state, "engine_client", None)
        return client, getattr(client, "vllm_config", None)

    async def get_apps(request: Request):
        _, cfg = _config(request)
        if cfg is None:
            return _error(503, "the engine is not ready")
        return JSONResponse(list_apps(cfg))

    async def change(request: Request, action: str, name: str | None):
        args = request.app.state.args
        try:
            check_key(request.headers, getattr(args, "api_key", None))
            check_content_type(request.headers)
            if int(getattr(args, "api_server_count", 1) or 1) > 1:
                raise AdminError(501, "apps cannot change with several API server processes (--api-server-count > "
                                      "1): each checks requests against its own copy of the apps")
            client, cfg = _config(request)
            if cfg is None:
                raise AdminError(503, "the engine is not ready")
            try:
                raw = await request.body()
            except ClientDisconnect:  # the client went away before its body arrived: nothing to change or answer
                return Response(status_code=400)
            body = parse_body(raw)
            async with lock:  # one change at a time: versions, live sets and the front end's apps agree
                ch = prepare_change(cfg, action, name, body)
                live = live_versions(client.output_processor)
                payload = {**ch.payload, "live": live}
                results = await client.collective_rpc("xmix_admin", args=(payload,))
                bad = [r for r in results if not (isinstance(r, dict) and r.get("ok"))]
                if bad:
                    r = bad[0] if isinstance(bad[0], dict) else {}
                    raise AdminError(int(r.get("status", 500)), str(r.get("error", f"worker answered {bad[0]!r}")))
                commit_change(cfg, ch)
        except AdminError as e:
            return _error(e.status, str(e))
        logger.info("vllm_xmix: app %r %s, version %d", ch.payload["name"],
                    "replaced" if action == "replace" else "added", ch.payload["version"])
        listed = next(a for a in list_apps(cfg)["data"] if a["name"] == ch.payload["name"])
        # the versions requests in flight kept running (the previous one of this app among them)
        listed["in_flight_versions"] = live
        return JSONResponse(listed, status_code=200 if action == "replace" else 201)

    async def replace_app(name: str, request: Request):
        return await change(request, "replace", name)

    async def add_app(request: Request):
        return await change(request, "add", None)

    app.add_api_route("/v1/mi/apps", get_apps, methods=["GET"])
    app.add_api_route("/v1/mi/apps/{name}", replace_app, methods=["POST"])
    app.add_api_route("/v1/mi/apps", add_app, methods=["POST"])
