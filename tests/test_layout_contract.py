"""vLLM's adapter meets the layout contract of ``tests/layout_contract.py`` (SGLang's: in
tests/sglang_engine/test_sglang_layout_contract.py, with the same cases and expected boxes)."""

import pytest

from layout_contract import CASES, check_adapter


def test_vllm_adapter_meets_the_layout_contract():
    linear = pytest.importorskip("vllm.model_executor.layers.linear")
    from mxfp8_learner_grid.vllm_plugin.sync_adapter import VLLMAdapter
    assert check_adapter(VLLMAdapter, linear) == sum(len(c[3]) for c in CASES.values())


def test_linear_facts_refuse_an_unknown_kind():
    from mxfp8_learner_grid.common.sync.expect import LinearFacts
    with pytest.raises(ValueError, match="kind"):
        LinearFacts("column")
