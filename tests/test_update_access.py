"""Update routes are closed by default: no API key -> refused unless the server listens on loopback;
grid_nccl_init joins only loopback or operator-listed rendezvous hosts (common/sync/security.py)."""

import asyncio
import json
import types

import pytest

from mxfp8_learner_grid.common.sync.security import (NCCL_HOSTS_ENV, Refused, check_rendezvous, check_update_access,
                                                      is_loopback)


def test_loopback_and_access_rules(monkeypatch):
    assert is_loopback("127.0.0.1") and is_loopback("127.8.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback(None) and not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5") and not is_loopback("")
    check_update_access("127.0.0.1", set())
    check_update_access(None, {"k"})
    with pytest.raises(Refused, match="need an API key.*all interfaces") as exc:
        check_update_access(None, set())
    assert "--api-key" in str(exc.value) and "VLLM_API_KEY" not in str(exc.value)   # no engine's name by default
    with pytest.raises(Refused, match=r"need an API key \(--api-key / --admin-api-key\)"):
        check_update_access("0.0.0.0", set(), key_flags="--api-key / --admin-api-key")   # the caller's wording
    monkeypatch.delenv(NCCL_HOSTS_ENV, raising=False)
    check_rendezvous("127.0.0.1")
    with pytest.raises(Refused, match="10.1.2.3.*MXFP8_GRID_NCCL_HOSTS"):
        check_rendezvous("10.1.2.3")
    monkeypatch.setenv(NCCL_HOSTS_ENV, "10.1.2.3, trainer-0")
    check_rendezvous("10.1.2.3")
    check_rendezvous("trainer-0")


def _call(mw, path, body, host=None, api_key=None, headers=()):
    sent = []

    async def receive():
        return {"body": json.dumps(body).encode(), "more_body": False}

    async def send(msg):
        sent.append(msg)
    state = types.SimpleNamespace(args=types.SimpleNamespace(host=host, api_key=api_key), engine_client=None)
    scope = {"type": "http", "path": path, "method": "POST", "app": types.SimpleNamespace(state=state),
             "headers": list(headers)}
    asyncio.run(mw(scope, receive, send))
    return sent[0]["status"], json.loads(sent[1]["body"])


def test_middleware_is_closed_by_default(monkeypatch):
    pytest.importorskip("vllm")
    from mxfp8_learner_grid.vllm_plugin import http
    monkeypatch.setenv("MXFP8_GRID_UPDATES", "1")
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.delenv(NCCL_HOSTS_ENV, raising=False)
    mw = http.GridUpdateMiddleware(None)
    nccl = {"method": "grid_nccl_init", "args": [json.dumps({"host": "203.0.113.7", "port": 1, "world_size": 2})]}
    status, out = _call(mw, "/grid/rpc", nccl, host="0.0.0.0")
    assert status == 403 and "API key" in out["error"]                       # open to the network, no key
    assert "--api-key / VLLM_API_KEY" in out["error"]                         # vLLM's ways to give one
    status, out = _call(mw, "/grid/rpc", nccl, host="127.0.0.1")
    assert status == 403 and "203.0.113.7" in out["error"]                   # loopback server, foreign rendezvous
    status, out = _call(mw, "/grid/rpc", nccl, host="0.0.0.0", api_key="K", headers=[(b"authorization", b"Bearer K")])
    assert status == 403 and "MXFP8_GRID_NCCL_HOSTS" in out["error"]         # the key does not open other hosts
    status, out = _call(mw, "/grid/rpc", nccl, host="0.0.0.0", api_key="K")
    assert status == 401                                                     # and without the key: unauthorized
