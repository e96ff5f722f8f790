"""SGLang 0.5.17 - 0.5.23: the bridge's update access closed by default, as the vLLM plugin's routes.

The SGLang bridge (``sglang_plugin/updater.py``) is reached through SGLang's own weight-update
routes (``/update_weights_from_tensor`` with ``load_format=GRID_LOADER``,
``/init_weights_update_group``), which SGLang guards only with its ``--api-key`` /
``--admin-api-key`` when those are set.  The rules of ``common/sync/security.py`` apply here too,
through two hooks on ``WeightUpdater`` (``model_executor/model_runner_components/weight_updater.py``,
the same class in both versions; every TP rank's scheduler has one):

* AFTER ``WeightUpdater.__init__``: with the grid loader enabled (``--custom-weight-loader``
  names ``GRID_LOADER``), a server that listens beyond loopback without an API key is refused
  at start-up (``Refused``, naming the flags);
* AROUND ``WeightUpdater.init_weights_update_group``: with the grid loader enabled, the workers
  join only a rendezvous address that is loopback or listed in ``MXFP8_GRID_NCCL_HOSTS``; any
  other answers SGLang's ``(False, message)`` -- the request fails, nothing joins, the server
  keeps serving.

Engines without the grid loader are untouched.  Registered only for the versions read; on any
other SGLang the hooks are not registered, an error is logged, and the bridge refuses every grid
call (``GridWorker.call`` checks :func:`covers`) until the patch is checked against that version.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("mxfp8_learner_grid.sglang")

WRITTEN_FOR = ((0, 5, 17), (0, 5, 23))
TARGET = "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater"
_registered = False


def bridge_enabled(updater) -> bool:
    from mxfp8_learner_grid.sglang_plugin.updater import GRID_LOADER
    return GRID_LOADER in (getattr(updater, "custom_weight_loaders", None) or {})


def check_start(server_args) -> None:
    """Refuse a bridge reachable from the network without an API key (``server_args``: SGLang's)."""
    from mxfp8_learner_grid.common.sync.security import check_update_access
    from mxfp8_learner_grid.sglang_plugin.updater import API_KEY_FLAGS
    if server_args is None:               # an in-process Engine outside a server: no HTTP routes
        return
    keys = {k for k in (getattr(server_args, "api_key", None), getattr(server_args, "admin_api_key", None)) if k}
    check_update_access(getattr(server_args, "host", None), keys, key_flags=API_KEY_FLAGS)


def _after_init(result, self, *args, **kwargs):
    if bridge_enabled(self):
        from mxfp8_learner_grid.sglang_plugin import compat
        check_start(compat.server_args())
    return result


def _around_group(original, self, master_address, *args, **kwargs):
    if bridge_enabled(self):
        from mxfp8_learner_grid.common.sync.security import Refused, check_rendezvous
        try:
            check_rendezvous(master_address)
        except Refused as exc:
            logger.warning("mxfp8-learner-grid: init_weights_update_group refused: %s", exc)
            return False, f"mxfp8-learner-grid: {exc}"
    return original(self, master_address, *args, **kwargs)


def covers(sglang_version: tuple[int, int, int]) -> bool:
    """Was this patch written for ``sglang_version``?"""
    return WRITTEN_FOR[0] <= tuple(sglang_version) <= WRITTEN_FOR[1]


def not_covered_message(sglang_version) -> str:
    return ("the update-access patch (patches/sglang_update_access.py) was written for SGLang %s - %s, this is %s: "
            "grid updates are refused until it is checked against this version"
            % tuple(".".join(map(str, v)) for v in (*WRITTEN_FOR, tuple(sglang_version))))


def register(sglang_version: tuple[int, int, int]) -> bool:
    """Register the hooks (applied by SGLang's load_plugins); returns whether they were registered."""
    global _registered
    if _registered:
        return True
    if not covers(sglang_version):
        logger.error("mxfp8-learner-grid: %s", not_covered_message(sglang_version))
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    HookRegistry.register(TARGET + ".__init__", _after_init, HookType.AFTER)
    HookRegistry.register(TARGET + ".init_weights_update_group", _around_group, HookType.AROUND)
    _registered = True
    return True
