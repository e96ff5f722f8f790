"""Run a script under Triton's CPU interpreter (``TRITON_INTERPRET=1`` must be set before Triton
decorates the kernels, hence a subprocess) and check that it printed OK."""

import os
import subprocess
import sys


def run_ok(script: str, timeout: int = 600) -> str:
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout)
    assert r.returncode == 0 and "OK" in r.stdout, (r.stdout + r.stderr)[-3000:]
    return r.stdout
