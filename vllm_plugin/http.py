"""Weight-update routes for a running ``vllm serve``, as an ASGI middleware (vLLM's ``--middleware``).

    MXFP8_GRID_UPDATES=1 vllm serve MODEL --quantization mxfp8-learner-grid \\
        --worker-extension-cls mxfp8_learner_grid.vllm_plugin.worker.GridWorkerExtension \\
        --middleware mxfp8_learner_grid.vllm_plugin.http.GridUpdateMiddleware [--api-key KEY]

Routes (off unless ``MXFP8_GRID_UPDATES=1``; closed by default: without an API key --
``--api-key`` or ``VLLM_API_KEY`` -- they answer 403 unless the server listens on loopback only,
and with one they need ``Authorization: Bearer KEY``; ``grid_nccl_init`` joins only loopback or
``MXFP8_GRID_NCCL_HOSTS`` rendezvous addresses, ``common/sync/security.py``):

    POST /grid/rpc                {"method": "grid_...", "args": ["...", ...]}
    POST /grid/pause              drain in-flight requests, hold new ones
    POST /grid/resume
    POST /grid/reset_prefix_cache
    GET  /grid/version

Only the worker extension's ``grid_*`` methods are callable, only with string arguments, and a
bucket source over HTTP can only be a safetensors file inside ``MXFP8_GRID_STAGING_DIRS``
(default ``/dev/shm``, the temp dir): no pickles cross the network.  A malformed payload gets
a 4xx naming the problem; an update the engine rejects is rolled back before the reply.
Every response of the server carries ``X-Weight-Version``.

A trainer that dies or stalls mid-update cannot leave the server paused: once generation is
paused for an update and no ``/grid/*`` request arrives for ``MXFP8_GRID_STALL_TIMEOUT_S``
(default 300 s), the server aborts the update on every rank -- whatever was not committed
rolls back, whole; a committed update stays -- and resumes generation.  ``/grid/version``
reports such expired updates.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time

from mxfp8_learner_grid.common.sync.protocol import (METHODS, NCCL_INIT, BadRequest, check_bearer, check_call,
                                                     error_reply, parse_body)
from mxfp8_learner_grid.common.sync.rank_service import checked
from mxfp8_learner_grid.common.sync.security import check_update_access

ENABLE_ENV = "MXFP8_GRID_UPDATES"
#: a paused update whose trainer sends nothing for this long is aborted (rolled back) and generation resumes
STALL_ENV = "MXFP8_GRID_STALL_TIMEOUT_S"
DEFAULT_STALL_S = 300.0
ALLOWED = frozenset(METHODS + (NCCL_INIT,))
#: how a vLLM server is given an API key (named when the routes are refused without one)
API_KEY_FLAGS = "--api-key / VLLM_API_KEY"
_state = {"version": 0, "paused_at": None, "last": 0.0, "watchdog": None, "expired": []}
log = logging.getLogger("mxfp8_learner_grid.vllm")


def stall_timeout() -> float:
    return float(os.environ.get(STALL_ENV, DEFAULT_STALL_S))


class GridUpdateMiddleware:

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)
        if scope.get("path", "").startswith("/grid/"):
            return await self._grid(scope, receive, send)

        async def send_with_version(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", [])) + [(b"x-weight-version", str(_state["version"]).encode())]
                message = dict(message, headers=headers)
            await send(message)
        return await self.app(scope, receive, send_with_version)

    # -- the routes ------------------------------------------------------------------
    async def _grid(self, scope, receive, send):
        try:
            if os.environ.get(ENABLE_ENV) != "1":
                raise BadRequest(404, f"weight-update routes are off (set {ENABLE_ENV}=1)")
            app_state = scope["app"].state
            keys = self._keys(app_state)
            check_update_access(getattr(getattr(app_state, "args", None), "host", None), keys, API_KEY_FLAGS)
            check_bearer(dict(scope.get("headers") or []).get(b"authorization", b"").decode(), keys)
            body = await self._body(receive)
            client = app_state.engine_client
            path, method = scope["path"], scope.get("method", "GET")
            if path != "/grid/version":           # status polls are not a trainer's progress
                _state["last"] = time.monotonic()
            if path == "/grid/version":
                out = {"version": _state["version"], "paused": _state["paused_at"] is not None,
                       "expired_updates": list(_state["expired"])}
            elif method != "POST":
                raise BadRequest(405, f"{path} takes POST")
            elif path == "/grid/pause":
                await client.pause_generation(mode="wait", clear_cache=False)
                _state["paused_at"] = _state["last"] = time.monotonic()
                self._watch(client)
                out = {"paused": True, "stall_timeout_s": stall_timeout()}
            elif path == "/grid/resume":
                await client.resume_generation()
                _state["paused_at"] = None
                out = {"paused": False}
            elif path == "/grid/reset_prefix_cache":
                out = {"reset": bool(await client.reset_prefix_cache())}
            elif path == "/grid/rpc":
                out = {"results": await self._rpc(client, body)}
            else:
                raise BadRequest(404, f"no route {path}")
            await self._reply(send, 200, out)
        except Exception as e:            # a bad request (4xx), a refusal (403), the engine refused (422)
            await self._reply(send, *error_reply(e))

    # -- a trainer that dies or stalls mid-update ------------------------------------------
    def _watch(self, client) -> None:
        """While generation is paused for an update, abort it (every rank rolls back whatever was
        not committed) and resume generation once the trainer has been silent for ``stall_timeout()``."""
        task = _state["watchdog"]
        if task is not None and not task.done():
            return
        _state["watchdog"] = asyncio.get_running_loop().create_task(self._watchdog(client))

    async def _watchdog(self, client) -> None:
        while _state["paused_at"] is not None:
            limit = stall_timeout()
            idle = time.monotonic() - _state["last"]
            if idle < limit:
                await asyncio.sleep(min(1.0, limit - idle + 0.05))
                continue
            log.warning("mxfp8-learner-grid: the trainer sent nothing for %.0f s during an update: aborting it "
                        "(rolled back unless committed) and resuming generation", idle)
            try:
                results = await client.collective_rpc("grid_update_abort")
                _state["expired"].append({"after_s": round(idle, 1), "ranks": results})
            finally:
                _state["paused_at"] = None
                await client.resume_generation()

    async def _rpc(self, client, body):
        method, args = check_call(body, ALLOWED)
        # a begin that a rank refused raises here: 422, its problems by condition in the body
        results = checked(method, await client.collective_rpc(method, args=tuple(args)))
        if method == "grid_update_commit" and results and all(r.get("applied") for r in results):
            _state["version"] = int(results[0]["version"])
        return results

    @staticmethod
    def _keys(app_state) -> set:
        keys = set()
        env = os.environ.get("VLLM_API_KEY")
        if env:
            keys.add(env)
        args = getattr(app_state, "args", None)
        api_key = getattr(args, "api_key", None) if args is not None else None
        for k in ([api_key] if isinstance(api_key, str) else (api_key or [])):
            keys.add(k)
        return keys

    async def _body(self, receive):
        chunks, more = [], True
        while more:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        return parse_body(b"".join(chunks))

    async def _reply(self, send, status: int, obj) -> None:
        body = json.dumps(obj, default=str).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"x-weight-version", str(_state["version"]).encode())]})
        await send({"type": "http.response.body", "body": body})
