"""SGLang's adapter meets the same layout contract as vLLM's (``tests/layout_contract.py``)."""

import os
import sys

import pytest

from sgl_env import sglang_installed  # noqa: E402

if not sglang_installed():
    pytest.skip("SGLang is not installed (tests/sglang_engine run in .venv-sglang)", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from layout_contract import CASES, check_adapter  # noqa: E402


def test_sglang_adapter_meets_the_layout_contract():
    from sglang.srt.layers import linear
    from mxfp8_learner_grid.sglang_plugin.sync_adapter import SGLangAdapter
    assert check_adapter(SGLangAdapter, linear) == sum(len(c[3]) for c in CASES.values())
