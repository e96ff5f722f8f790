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
import tempfile
import time

from mxfp8_learner_grid.common.sync.rank_service import checked
from mxfp8_learner_grid.common.sync.manifest import Manifest
from mxfp8_learner_grid.common.sync.security import Refused, check_rendezvous, check_update_access

ENABLE_ENV = "MXFP8_GRID_UPDATES"
STAGING_ENV = "MXFP8_GRID_STAGING_DIRS"
#: a paused update whose trainer sends nothing for this long is aborted (rolled back) and generation resumes
STALL_ENV = "MXFP8_GRID_STALL_TIMEOUT_S"
DEFAULT_STALL_S = 300.0
ALLOWED = {"grid_update_begin", "grid_update_load", "grid_update_finish", "grid_update_commit", "grid_update_abort",
           "grid_state", "grid_fingerprints", "grid_nccl_init"}
_state = {"version": 0, "paused_at": None, "last": 0.0, "watchdog": None, "expired": []}
log = logging.getLogger("mxfp8_learner_grid.vllm")


def stall_timeout() -> float:
    return float(os.environ.get(STALL_ENV, DEFAULT_STALL_S))


def _staging_dirs() -> list[str]:
    dirs = os.environ.get(STAGING_ENV)
    base = dirs.split(",") if dirs else ["/dev/shm", tempfile.gettempdir()]
    return [os.path.realpath(d) for d in base if d]


class HTTPError(Exception):
    def __init__(self, status: int, msg: str):
        super().__init__(msg)
        self.status = status


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
                raise HTTPError(404, f"weight-update routes are off (set {ENABLE_ENV}=1)")
            app_state = scope["app"].state
            keys = self._keys(app_state)
            try:
                check_update_access(getattr(getattr(app_state, "args", None), "host", None), keys)
            except Refused as exc:
                raise HTTPError(403, str(exc)) from None
            self._auth(scope, keys)
            body = await self._body(receive)
            client = app_state.engine_client
            path, method = scope["path"], scope.get("method", "GET")
            if path != "/grid/version":           # status polls are not a trainer's progress
                _state["last"] = time.monotonic()
            if path == "/grid/version":
                out = {"version": _state["version"], "paused": _state["paused_at"] is not None,
                       "expired_updates": list(_state["expired"])}
            elif method != "POST":
                raise HTTPError(405, f"{path} takes POST")
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
                raise HTTPError(404, f"no route {path}")
            await self._reply(send, 200, out)
        except HTTPError as e:
            await self._reply(send, e.status, {"error": str(e)})
        except Exception as e:            # the engine refused the update (validation, rollback, ...)
            body = {"error": f"{type(e).__name__}: {e}"}
            if getattr(e, "problems", None):
                body["problems"] = e.problems    # {condition: [problem, ...]}: data, not words to parse
            await self._reply(send, 422, body)

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
        if not isinstance(body, dict) or "method" not in body:
            raise HTTPError(400, "body must be {\"method\": ..., \"args\": [...]}")
        method, args = body["method"], body.get("args", [])
        if method not in ALLOWED:
            raise HTTPError(400, f"method {method!r} is not a grid update method; allowed: {sorted(ALLOWED)}")
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise HTTPError(400, "args must be a list of strings")
        if method == "grid_update_load":
            self._check_source(args[0] if args else "")
        if method == "grid_nccl_init":
            try:
                info = json.loads(args[0]) if args else None
                host = info["host"]
            except Exception:
                raise HTTPError(400, "grid_nccl_init takes {\"host\", \"port\", \"world_size\", \"rank_offset\"}") from None
            try:
                check_rendezvous(str(host))
            except Refused as exc:
                raise HTTPError(403, str(exc)) from None
        if method in ("grid_update_begin",):
            try:
                manifest = json.loads(args[0]) if args else None
            except Exception as exc:
                raise HTTPError(400, f"manifest is not JSON: {exc}") from None
            try:
                Manifest.from_dict(manifest)
            except ValueError as exc:
                raise HTTPError(400, str(exc)) from None
        # a begin that a rank refused raises here: 422, its problems by condition in the body
        results = checked(method, await client.collective_rpc(method, args=tuple(args)))
        if method == "grid_update_commit" and results and all(r.get("applied") for r in results):
            _state["version"] = int(results[0]["version"])
        return results

    def _check_source(self, src_json: str) -> None:
        try:
            src = json.loads(src_json)
        except Exception as exc:
            raise HTTPError(400, f"bucket source is not JSON: {exc}") from None
        if isinstance(src, dict) and src.get("kind") == "nccl":
            t = src.get("tensors")
            if not isinstance(t, list) or not all(isinstance(e, list) and len(e) == 3 and isinstance(e[0], str)
                                                  and isinstance(e[1], str) and isinstance(e[2], list) for e in t):
                raise HTTPError(400, "an nccl bucket source is {\"kind\": \"nccl\", \"tensors\": [[name, dtype, shape], ...]}")
            return
        if not isinstance(src, dict) or src.get("kind") != "safetensors":
            raise HTTPError(400, "over HTTP a bucket source must be {\"kind\": \"safetensors\", \"path\": ...} "
                                 "or {\"kind\": \"nccl\", ...}")
        path = os.path.realpath(str(src.get("path", "")))
        if not any(path.startswith(d + os.sep) for d in _staging_dirs()):
            raise HTTPError(400, f"bucket path must be inside {_staging_dirs()} ({STAGING_ENV})")
        if not os.path.isfile(path):
            raise HTTPError(400, f"bucket file {path} does not exist (truncated transfer?)")

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

    def _auth(self, scope, keys: set) -> None:
        if not keys:
            return
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"").decode()
        if auth not in {f"Bearer {k}" for k in keys}:
            raise HTTPError(401, "weight updates need the server's API key")

    async def _body(self, receive):
        chunks, more = [], True
        while more:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        raw = b"".join(chunks)
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:     # bytes that are not UTF-8/16/32: not JSON
            raise HTTPError(400, f"body is not JSON: {exc}") from None

    async def _reply(self, send, status: int, obj) -> None:
        body = json.dumps(obj, default=str).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"x-weight-version", str(_state["version"]).encode())]})
        await send({"type": "http.response.body", "body": body})
