"""vLLM's compiled Marlin ops as the plugins call them (``vllm_plugin/marlin_ops.py``), on CPU.

What can be checked without a GPU: the scalar-type id handed to the ops equals vLLM's own, the
argument-list check accepts vLLM 0.26.0's schemas exactly as its libraries declare them and names
an op whose arguments changed, and a missing library is reported, not raised.  The ops themselves
run in ``tests/gpu/test_fast_path.py`` (in vLLM's and in SGLang's environment).
"""

import pytest
import torch

from mxfp8_learner_grid.vllm_plugin import marlin_ops
from mxfp8_learner_grid.vllm_plugin.marlin_ops import (FLOAT8_E4M3FN_ID, SCHEMAS, compiled_marlin_ops,
                                                       load_compiled_ops, scalar_type_id, schema_mismatch)

#: the schemas as vLLM 0.26.0's libraries declare them (``strings`` of
#: _C_stable_libtorch.abi3.so and _moe_C_stable_libtorch.abi3.so, whitespace as there)
DECLARED = {
    "marlin_gemm": "marlin_gemm(Tensor a, Tensor? c_or_none, Tensor b_q_weight, Tensor? b_bias_or_none,Tensor b_scales, "
                   "Tensor? a_scales, Tensor? global_scale, Tensor? b_zeros_or_none, Tensor? g_idx_or_none, "
                   "Tensor? perm_or_none, Tensor workspace, int b_type_id, SymInt size_m, SymInt size_n, SymInt size_k, "
                   "bool is_k_full, bool use_atomic_add, bool use_fp32_reduce, bool is_zp_float) -> Tensor",
    "gptq_marlin_repack": "gptq_marlin_repack(Tensor b_q_weight, Tensor perm, SymInt size_k, SymInt size_n, "
                          "int num_bits, bool is_a_8bit) -> Tensor",
    "moe_wna16_marlin_gemm": "moe_wna16_marlin_gemm(Tensor! a, Tensor? c_or_none,Tensor! b_q_weight, "
                             "Tensor? b_bias_or_none,Tensor! b_scales, Tensor? a_scales, Tensor? global_scale, "
                             "Tensor? b_zeros_or_none,Tensor? g_idx_or_none, Tensor? perm_or_none, Tensor! workspace,"
                             "Tensor sorted_token_ids,Tensor! expert_ids, Tensor! num_tokens_past_padded,"
                             "Tensor! topk_weights, int moe_block_size, int top_k, bool mul_topk_weights, "
                             "int b_type_id,int size_m, int size_n, int size_k,bool is_full_k, bool use_atomic_add,"
                             "bool use_fp32_reduce, bool is_zp_float,int thread_k, int thread_n, "
                             "int blocks_per_sm) -> Tensor",
    "moe_align_block_size": "moe_align_block_size(Tensor topk_ids, int num_experts,                     "
                            "int block_size, Tensor! sorted_token_ids,                     Tensor! experts_ids,"
                            "                     Tensor! num_tokens_post_pad,                     "
                            "Tensor? maybe_expert_map) -> ()",
}
TEST_NS = "mxfp8_grid_marlin_schema_test"
_lib = torch.library.Library(TEST_NS, "DEF")
for _schema in DECLARED.values():
    _lib.define(_schema)
_lib.define("marlin_gemm_changed(Tensor a, Tensor? c_or_none, Tensor b_q_weight, Tensor? b_bias_or_none, "
            "Tensor b_scales, Tensor? a_scales, Tensor? global_scale, Tensor? b_zeros_or_none, Tensor? g_idx_or_none, "
            "Tensor? perm_or_none, Tensor workspace, int b_type_id, SymInt size_m, SymInt size_n, SymInt size_k, "
            "bool is_k_full, bool use_atomic_add, bool use_fp32_reduce) -> Tensor")


def test_the_e4m3_type_id_is_vllms():
    st = pytest.importorskip("vllm.scalar_type")
    assert FLOAT8_E4M3FN_ID == st.scalar_types.float8_e4m3fn.id


def test_the_id_packing_is_vllms_for_every_scalar_type():
    """The packing itself, over all of vLLM's named types (a field out of place fails most of them)."""
    st = pytest.importorskip("vllm.scalar_type")
    types = [v for v in vars(st.scalar_types).values() if isinstance(v, st.ScalarType)]
    assert len(types) > 10
    for t in types:
        assert scalar_type_id(t.exponent, t.mantissa, t.signed, t.bias, t._finite_values_only,
                              t.nan_repr.value) == t.id, t


@pytest.mark.parametrize("op", sorted(DECLARED))
def test_vllm_0_26_schemas_are_accepted(op, monkeypatch):
    qual = next(q for q in SCHEMAS if q.endswith("::" + op))
    monkeypatch.setitem(SCHEMAS, f"{TEST_NS}::{op}", SCHEMAS[qual])
    assert schema_mismatch(f"{TEST_NS}::{op}") is None


def test_a_changed_schema_is_named(monkeypatch):
    monkeypatch.setitem(SCHEMAS, f"{TEST_NS}::marlin_gemm_changed", SCHEMAS["_C::marlin_gemm"])
    why = schema_mismatch(f"{TEST_NS}::marlin_gemm_changed")
    assert why and "marlin_gemm_changed" in why and "is_zp_float" in why


def test_an_op_that_is_not_loaded_is_named():
    assert "not loaded" in schema_mismatch(f"{TEST_NS}::nothing_here")


def test_missing_libraries_are_reported_not_raised(tmp_path, monkeypatch):
    monkeypatch.setattr(marlin_ops, "_loaded", lambda ns, names: False)
    dense, moe, why = load_compiled_ops(str(tmp_path))
    assert (dense, moe) == (False, False)
    assert "_C_stable_libtorch.abi3.so not found in" in why and str(tmp_path) in why


def test_a_library_that_does_not_load_is_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(marlin_ops, "_loaded", lambda ns, names: False)
    for lib in marlin_ops.LIBRARIES:
        (tmp_path / lib).write_bytes(b"not an ELF file")
    dense, moe, why = load_compiled_ops(str(tmp_path))
    assert (dense, moe) == (False, False) and "does not load" in why


def test_the_ops_directory_option(monkeypatch, tmp_path):
    monkeypatch.setenv(marlin_ops.OPS_DIR_ENV, str(tmp_path))
    assert marlin_ops.vllm_ops_dir() == str(tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU answer")
def test_no_provider_without_cuda():
    ops, why = compiled_marlin_ops()
    assert ops is None and "CUDA" in why
