"""The grid calls as a request/response protocol, whatever carries them (HTTP routes, a bridge).

Server side: which methods a remote caller may name, what their arguments must look like
(:func:`check_call`: strings only; a bucket source over the network is a staged safetensors
file inside the allowed staging dirs or an nccl description; a rendezvous host the operator
allowed; a manifest that parses), and how an error maps to a status code and a body
(:func:`error_reply`).  Client side: :class:`JSONClient` posts and turns a refusal back into
:class:`UpdateRejected` with its problems by condition (:func:`raise_error`).
"""

from __future__ import annotations

import hmac
import json
import os
import tempfile
from typing import Optional

from .manifest import Manifest
from .recorder import UpdateRejected
from .security import Refused, check_rendezvous

#: the ``grid_*`` calls of every rank (``rank_service.RankService``)
METHODS = ("grid_update_begin", "grid_update_load", "grid_update_finish", "grid_update_commit",
           "grid_update_abort", "grid_state", "grid_fingerprints")
NCCL_INIT = "grid_nccl_init"
STAGING_ENV = "MXFP8_GRID_STAGING_DIRS"


class BadRequest(Exception):
    """A request refused with an HTTP-style status (4xx) and a message naming the problem."""

    def __init__(self, status: int, msg: str):
        super().__init__(msg)
        self.status = status


def allowed_dirs(env_var: str) -> list[str]:
    """The directories an operator allows in ``env_var`` (comma-separated; unset or empty: ``/dev/shm``
    and the temp dir), each resolved with ``os.path.realpath``; empty entries skipped.  Read at every
    call (the environment may change between calls)."""
    dirs = os.environ.get(env_var)
    base = dirs.split(",") if dirs else ["/dev/shm", tempfile.gettempdir()]
    return [os.path.realpath(d) for d in base if d]


def staging_dirs() -> list[str]:
    """Where a bucket file named over the network may live (``MXFP8_GRID_STAGING_DIRS``)."""
    return allowed_dirs(STAGING_ENV)


def _json_arg(text: str, what: str):
    try:
        return json.loads(text)
    except Exception as exc:
        raise BadRequest(400, f"{what} is not JSON: {exc}") from None


def check_source(src_json: str) -> None:
    """A bucket source from the network: an nccl description, or a safetensors file in the staging dirs."""
    src = _json_arg(src_json, "bucket source")
    if isinstance(src, dict) and src.get("kind") == "nccl":
        t = src.get("tensors")
        if not isinstance(t, list) or not all(isinstance(e, list) and len(e) == 3 and isinstance(e[0], str)
                                              and isinstance(e[1], str) and isinstance(e[2], list) for e in t):
            raise BadRequest(400, "an nccl bucket source is {\"kind\": \"nccl\", \"tensors\": [[name, dtype, shape], ...]}")
        return
    if not isinstance(src, dict) or src.get("kind") != "safetensors":
        raise BadRequest(400, "over HTTP a bucket source must be {\"kind\": \"safetensors\", \"path\": ...} "
                              "or {\"kind\": \"nccl\", ...}")
    path = os.path.realpath(str(src.get("path", "")))
    if not any(path.startswith(d + os.sep) for d in staging_dirs()):
        raise BadRequest(400, f"bucket path must be inside {staging_dirs()} ({STAGING_ENV})")
    if not os.path.isfile(path):
        raise BadRequest(400, f"bucket file {path} does not exist (truncated transfer?)")


def parse_body(raw: bytes):
    """A request body: JSON (empty: ``{}``), or :class:`BadRequest`."""
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:     # bytes that are not UTF-8/16/32: not JSON
        raise BadRequest(400, f"body is not JSON: {exc}") from None


def check_call(body, allowed=METHODS + (NCCL_INIT,)) -> tuple[str, list]:
    """``(method, args)`` of a remote ``{"method": ..., "args": [...]}``, or :class:`BadRequest`."""
    if not isinstance(body, dict) or "method" not in body:
        raise BadRequest(400, "body must be {\"method\": ..., \"args\": [...]}")
    method, args = body["method"], body.get("args", [])
    if method not in allowed:
        raise BadRequest(400, f"method {method!r} is not a grid update method; allowed: {sorted(allowed)}")
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise BadRequest(400, "args must be a list of strings")
    if method == "grid_update_load":
        check_source(args[0] if args else "")
    if method == NCCL_INIT:
        try:
            host = json.loads(args[0])["host"]
        except Exception:
            raise BadRequest(400, "grid_nccl_init takes {\"host\", \"port\", \"world_size\", \"rank_offset\"}") from None
        try:
            check_rendezvous(str(host))
        except Refused as exc:
            raise BadRequest(403, str(exc)) from None
    if method == "grid_update_begin":
        manifest = _json_arg(args[0], "manifest") if args else None
        try:
            Manifest.from_dict(manifest)
        except ValueError as exc:
            raise BadRequest(400, str(exc)) from None
    return method, args


def check_bearer(authorization: str, keys: set) -> None:
    """With API keys configured, the request must carry ``Authorization: Bearer <one of them>``
    (compared in constant time: the answer's timing says nothing about how much of a key matched)."""
    if not keys:
        return
    given = (authorization or "").encode()
    if not any(hmac.compare_digest(given, f"Bearer {k}".encode()) for k in keys):
        raise BadRequest(401, "weight updates need the server's API key")


def error_reply(exc: BaseException) -> tuple[int, dict]:
    """(status, body) for an error: a :class:`BadRequest` its own status, a policy refusal 403, anything
    else -- the engine refused the update (validation, rollback, ...) -- 422 with the problems by
    condition as data when it has them."""
    if isinstance(exc, BadRequest):
        return exc.status, {"error": str(exc)}
    if isinstance(exc, Refused):
        return 403, {"error": str(exc)}
    body = {"error": f"{type(exc).__name__}: {exc}"}
    if getattr(exc, "problems", None):
        body["problems"] = exc.problems          # {condition: [problem, ...]}: data, not words to parse
    return 422, body


def raise_error(status: int, body, where: str) -> None:
    """Client side of :func:`error_reply`: a refusal with problems comes back as :class:`UpdateRejected`."""
    if status == 422 and isinstance(body, dict) and body.get("problems"):
        raise UpdateRejected(body.get("error", ""), body["problems"])
    if status >= 400:
        text = body if isinstance(body, str) else json.dumps(body, default=str)
        raise RuntimeError(f"{where}: HTTP {status}: {text[:2000]}")


class JSONClient:
    """JSON over HTTP to a server's routes: one ``requests`` session, the API key as a bearer token."""

    def __init__(self, base_url: str, api_key: Optional[str] = None, timeout: float = 600):
        import requests
        self.s = requests.Session()
        self.base, self.timeout = base_url.rstrip("/"), timeout
        if api_key:
            self.s.headers["Authorization"] = f"Bearer {api_key}"

    def _request(self, verb: str, path: str, body=None):
        """(status, JSON body -- or the text when it is not JSON)."""
        r = self.s.request(verb, self.base + path, json=body if verb == "POST" else None, timeout=self.timeout)
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, r.text

    def _post(self, path: str, body=None):
        return self._request("POST", path, body or {})

    def _get(self, path: str):
        return self._request("GET", path)
