"""Registration: the entry point, SGLang's real argument parser, idempotency, loud failure, the fallback launcher.

Each case runs in a fresh interpreter: registration mutates process-global tables, and
SGLang's ``load_plugins()`` runs once per process.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from sgl_env import sglang_installed  # noqa: E402

if not sglang_installed():
    pytest.skip("SGLang is not installed (tests/sglang_engine run in .venv-sglang)", allow_module_level=True)

NAME = "mxfp8-learner-grid"
EP = "mxfp8_learner_grid"


def run(code: str, plugins: str = EP, args=(), module=None, timeout=300):
    env = dict(os.environ, SGLANG_PLUGINS=plugins, SGLANG_NCCL_SO_PATH="/nonexistent")
    cmd = [sys.executable, "-m", module, *args] if module else [sys.executable, "-c", textwrap.dedent(code)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def test_entry_point_is_declared():
    from importlib.metadata import entry_points
    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get(EP) == "mxfp8_learner_grid.sglang_plugin.register:register"


def test_load_plugins_registers_once_and_the_real_parser_accepts_it():
    r = run(f"""
        from sglang.srt.plugins import load_plugins
        load_plugins(); load_plugins()
        from mxfp8_learner_grid.sglang_plugin import compat
        from mxfp8_learner_grid.sglang_plugin.register import is_registered, register
        from mxfp8_learner_grid.sglang_plugin.config import LearnerGridConfig
        assert is_registered()
        register(); register()                       # idempotent
        assert compat.QUANTIZATION_CHOICES.count({NAME!r}) == 1, compat.QUANTIZATION_CHOICES
        import sglang.srt.layers.quantization as q
        assert q.QUANTIZATION_METHODS[{NAME!r}] is LearnerGridConfig
        assert q.CPU_QUANTIZATION_METHODS[{NAME!r}] is LearnerGridConfig
        assert q.get_quantization_config({NAME!r}) is LearnerGridConfig
        import torch; assert not torch.cuda.is_initialized()   # registration never touches CUDA
        from sglang.srt.server_args import prepare_server_args
        args = prepare_server_args(["--model-path", "dummy", "--quantization", {NAME!r}])
        assert args.quantization == {NAME!r}, args.quantization
        print("OK")
    """)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-6000:]


def test_parser_rejects_the_name_without_the_plugin():
    r = run(f"""
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.server_args import prepare_server_args
        prepare_server_args(["--model-path", "dummy", "--quantization", {NAME!r}])
        print("ACCEPTED")
    """, plugins="some_other_plugin")
    assert r.returncode == 2 and "ACCEPTED" not in r.stdout and "invalid choice" in r.stderr, r.stderr[-3000:]


def test_registration_failure_stops_the_process_through_load_plugins():
    r = run("""
        import mxfp8_learner_grid.sglang_plugin.compat as compat
        def broken():
            raise RuntimeError("simulated incompatibility")
        compat.check_version = broken
        from sglang.srt.plugins import load_plugins
        load_plugins()                               # catches Exception from plugins; not ours
        print("SERVING ANYWAY")
    """)
    assert r.returncode != 0 and "SERVING ANYWAY" not in r.stdout, r.stdout + r.stderr[-3000:]
    assert "mxfp8-learner-grid could not register" in r.stderr and "simulated incompatibility" in r.stderr
    assert "SGLANG_PLUGINS" in r.stderr


def test_fallback_launcher_registers_then_delegates():
    # the entry point is excluded: only the launcher can have added the choice that --help lists
    r = run("", plugins="some_other_plugin", module="mxfp8_learner_grid.sglang_plugin.launch_server",
            args=["--help"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--quantization" in r.stdout and NAME in r.stdout


def test_vllms_compiled_marlin_is_the_provider_where_its_libraries_load(monkeypatch, caplog):
    """Kernel providers beside SGLang (``compat.register_kernel_providers`` ->
    ``marlin_ops.register_provider``): the ops ``vllm_plugin.marlin_ops`` loaded are registered once; where they do not load, a warning
    names why and the chooser keeps the project's Triton kernels.  (The ops themselves run in
    ``tests/gpu/test_fast_path.py`` under SGLang's environment on the GPU.)"""
    import logging

    import torch
    from mxfp8_learner_grid.common.grid_kernels import providers
    from mxfp8_learner_grid.sglang_plugin import compat
    from mxfp8_learner_grid.vllm_plugin import marlin_ops

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(marlin_ops, "_tried", False)
    monkeypatch.setattr(marlin_ops, "load_compiled_ops", lambda where=None: (False, False, "nothing in /x"))
    providers.unregister("marlin")
    with caplog.at_level(logging.WARNING, logger="mxfp8_learner_grid"):
        compat.register_kernel_providers()
    assert providers.get("marlin") is None
    assert any("no MXFP8 Marlin in SGLang (nothing in /x)" in r.getMessage() for r in caplog.records)

    monkeypatch.setattr(marlin_ops, "_tried", False)
    monkeypatch.setattr(marlin_ops, "load_compiled_ops", lambda where=None: (True, True, "loaded /x/_C"))
    try:
        compat.register_kernel_providers()
        assert isinstance(providers.get("marlin"), marlin_ops.MarlinMoEOps)
        first = providers.get("marlin")
        compat.register_kernel_providers()
        assert providers.get("marlin") is first
    finally:
        providers.unregister("marlin")
