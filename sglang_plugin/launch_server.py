"""Fallback launcher: ``python -m mxfp8_learner_grid.sglang_plugin.launch_server <sglang args>``.

Registers the quantization method, then runs ``sglang.launch_server`` as ``__main__``
with the same arguments (whatever that SGLang version's launcher does).  For the
processes SGLang's entry-point loading does not reach: the plugin is registered at
*import* of this module, and ``multiprocessing`` (SGLang uses "spawn") re-imports the
parent's main module in every child, so every spawned child -- multi-tokenizer HTTP
workers (``--tokenizer-worker-num > 1``) included -- registers too.  Ray actors do not
import the main module: that mode is not covered (not verified either).
"""

from __future__ import annotations

import runpy

from mxfp8_learner_grid.sglang_plugin.register import register

register()

if __name__ == "__main__":
    # alter_sys=False keeps this module as sys.modules["__main__"], so spawned children
    # re-import it (and register) before they unpickle anything.
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)
