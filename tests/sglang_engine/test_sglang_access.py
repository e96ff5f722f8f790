"""The SGLang bridge closed by default (patches/sglang_update_access.py; issue #16): no update access
from the network without an API key, no NCCL rendezvous the operator did not allow, and no grid call
at all on an SGLang the patch was not checked against."""

import inspect
import pkgutil
import types

import pytest

from sgl_env import sglang_installed  # noqa: E402

if not sglang_installed():
    pytest.skip("SGLang is not installed (tests/sglang_engine run in .venv-sglang)", allow_module_level=True)

from mxfp8_learner_grid.common.sync.security import NCCL_HOSTS_ENV, Refused  # noqa: E402
from mxfp8_learner_grid.patches import sglang_update_access as access  # noqa: E402


def _updater(bridge=True):
    from mxfp8_learner_grid.sglang_plugin.updater import GRID_LOADER
    return types.SimpleNamespace(custom_weight_loaders={GRID_LOADER: object()} if bridge else {})


def test_hook_targets_exist_in_this_sglang(sgl):
    """The hooked class and methods are where the patch says, with the arguments it reads."""
    cls = pkgutil.resolve_name(access.TARGET)
    params = list(inspect.signature(inspect.unwrap(cls.init_weights_update_group)).parameters)
    assert params[:2] == ["self", "master_address"]
    assert "custom_weight_loaders" in inspect.signature(inspect.unwrap(cls.__init__)).parameters
    from mxfp8_learner_grid.sglang_plugin import compat
    assert access.covers(compat.SGLANG_VERSION) and access._registered       # register() (the fixture) did it


def test_start_up_refused_on_the_network_without_an_api_key():
    for host, key, admin in (("0.0.0.0", None, None), ("10.1.2.3", "", None), (None, None, None)):
        with pytest.raises(Refused, match="need an API key") as exc:
            access.check_start(types.SimpleNamespace(host=host, api_key=key, admin_api_key=admin))
        assert "--api-key / --admin-api-key" in str(exc.value) and "VLLM" not in str(exc.value)   # SGLang's flags
    for host, key, admin in (("127.0.0.1", None, None), ("localhost", None, None), ("0.0.0.0", "k", None),
                             ("0.0.0.0", None, "admin-k")):
        access.check_start(types.SimpleNamespace(host=host, api_key=key, admin_api_key=admin))
    access.check_start(None)                              # an in-process Engine: no HTTP routes


def test_after_init_checks_only_engines_with_the_bridge(monkeypatch):
    from mxfp8_learner_grid.sglang_plugin import compat
    monkeypatch.setattr(compat, "server_args", lambda: types.SimpleNamespace(host="0.0.0.0", api_key=None,
                                                                             admin_api_key=None))
    with pytest.raises(Refused):
        access._after_init(None, _updater(bridge=True))
    assert access._after_init(None, _updater(bridge=False)) is None      # SGLang's own updates: untouched


def test_rendezvous_outside_the_allowed_hosts_is_refused_and_nothing_joins(monkeypatch):
    monkeypatch.delenv(NCCL_HOSTS_ENV, raising=False)
    joined = []

    def original(self, master_address, master_port, rank_offset, world_size, group_name, backend="nccl"):
        joined.append(master_address)
        return True, "joined"
    ok, msg = access._around_group(original, _updater(), "203.0.113.7", 29500, 1, 2, "g")
    assert (ok, joined) == (False, []) and "203.0.113.7" in msg and NCCL_HOSTS_ENV in msg
    assert access._around_group(original, _updater(), "127.0.0.1", 29500, 1, 2, "g") == (True, "joined")
    monkeypatch.setenv(NCCL_HOSTS_ENV, "trainer-0, 203.0.113.7")
    assert access._around_group(original, _updater(), master_address="203.0.113.7", master_port=29500,
                                rank_offset=1, world_size=2, group_name="g") == (True, "joined")
    monkeypatch.delenv(NCCL_HOSTS_ENV)
    assert access._around_group(original, _updater(bridge=False), "203.0.113.7", 29500, 1, 2, "g") == (True, "joined")


def test_an_sglang_the_patch_does_not_cover_gets_no_grid_call(sgl, monkeypatch):
    from mxfp8_learner_grid.sglang_plugin import compat
    from mxfp8_learner_grid.sglang_plugin.updater import GridWorker
    assert not access.covers((0, 5, 24)) and not access.covers((0, 5, 16))
    monkeypatch.setattr(compat, "SGLANG_VERSION", (0, 5, 99))
    worker = GridWorker.__new__(GridWorker)                # the refusal comes before any state is read
    with pytest.raises(Refused, match="written for SGLang 0.5.17 - 0.5.23, this is 0.5.99"):
        worker.call("grid_state", [], [])
