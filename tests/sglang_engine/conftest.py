"""SGLang plugin tests: run in .venv-sglang (``make test`` does); skipped where SGLang is absent."""

import os
import sys

import pytest

os.environ.setdefault("SGLANG_NCCL_SO_PATH", "/nonexistent")   # no NCCL on CPU machines
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def sgl():
    """SGLang's TP=1 groups over gloo, the plugin registered; returns the helpers module."""
    import sgl_helpers
    sgl_helpers.init_dist()
    from mxfp8_learner_grid.sglang_plugin.register import register
    register()
    return sgl_helpers


@pytest.fixture(scope="session")
def learners():
    """{moe: (learner model on the grid, wire dict, BF16 dict)} for the tiny Qwen3 and Qwen3-MoE."""
    import sgl_helpers
    return {moe: sgl_helpers.learner_and_wire(moe) for moe in (False, True)}
