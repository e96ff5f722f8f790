"""Packed update buckets (``staging="cuda_ipc"``): one buffer per bucket, each tensor a view of it.

The packing is device-agnostic, so its layout, its reuse of the staging buffer and the engine-side
views are checked here on CPU; the IPC handle across processes is checked on the GPU
(``tests/gpu/test_ipc_pack.py``).  A packed bucket puts tensors of different dtypes in one storage,
so the write recorder must attribute writes by byte range, not by element offset."""

import pytest
import torch

from mxfp8_learner_grid.common import quantize_rows
from mxfp8_learner_grid.common.sync.recorder import WriteRecorder
from mxfp8_learner_grid.common.sync.transport import PACK_ALIGN, Stager, pack_bucket, pack_layout, packed_views


def _bucket(seed=0):
    g = torch.Generator().manual_seed(seed)
    q, s = quantize_rows(torch.randn(48, 96, generator=g))
    return [("l.q", q), ("l.q_scale_inv", s), ("norm", torch.randn(40, generator=g).to(torch.bfloat16)),
            ("bias", torch.randn(3, 5, generator=g)), ("odd", torch.randn(7, generator=g).to(torch.bfloat16).t())]


def test_pack_layout_is_aligned_and_round_trips_every_dtype():
    bucket = _bucket()
    buf, layout = pack_bucket(bucket)
    assert buf.dtype == torch.uint8
    offs = [e[3] for e in layout]
    assert offs == sorted(offs) and all(o % PACK_ALIGN == 0 for o in offs)
    views = packed_views(buf, layout)
    assert list(views) == [n for n, _ in bucket]
    for name, t in bucket:
        v = views[name]
        assert v.dtype == t.dtype and v.shape == t.shape and v.is_contiguous()
        assert torch.equal(v.view(torch.uint8), t.contiguous().view(torch.uint8)), name
        assert v.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        assert v.data_ptr() % PACK_ALIGN == buf.data_ptr() % PACK_ALIGN


def test_stager_reuses_its_staging_buffer_and_grows_only_for_a_larger_bucket():
    st = Stager("cuda_ipc")
    small, big = _bucket(1)[:2], _bucket(2)
    st._buffer, _ = pack_bucket(big, st._buffer)
    ptr = st._buffer.data_ptr()
    st._buffer, layout = pack_bucket(small, st._buffer)             # fits: the same memory
    assert st._buffer.data_ptr() == ptr
    assert torch.equal(packed_views(st._buffer, layout)["l.q"].view(torch.uint8), small[0][1].view(torch.uint8))
    larger = [("w", torch.zeros(pack_layout(big)[1] + 1, dtype=torch.uint8))]
    st._buffer, _ = pack_bucket(larger, st._buffer)
    assert st._buffer.numel() >= pack_layout(larger)[1] and st._buffer.data_ptr() != ptr
    st.done()                                                        # the update ended: memory back
    assert st._buffer is None


@pytest.mark.parametrize("entry, words", [
    (["w", "bfloat16", [4, 4], 8], "alignment"),
    (["w", "bfloat16", [1 << 20], 0], "outside"),
    (["w", "bfloat16", [4], -PACK_ALIGN], "outside"),
    (["w", "complex_thing", [4], 0], "unknown dtype"),
])
def test_packed_views_refuse_a_bad_layout_naming_the_tensor(entry, words):
    buf = torch.zeros(4 * PACK_ALIGN, dtype=torch.uint8)
    with pytest.raises(ValueError, match=f"w: .*{words}"):
        packed_views(buf, [entry])


def test_recorder_attributes_writes_from_a_packed_bucket_by_byte_range():
    """fp8 codes (1 byte), bf16 (2 bytes) and fp32 (4 bytes) in one buffer: a slice of the codes whose
    element offsets fall inside the bf16 tensor's element range must still be the codes' write (an
    element-offset match would name the bf16 tensor)."""
    q = torch.randint(0, 0x7E, (16, 256), dtype=torch.uint8).view(torch.float8_e4m3fn)    # 4096 bytes
    n = torch.randn(1024).to(torch.bfloat16)                                             # bytes [4096, 6144)
    b = torch.randn(64)
    buf, layout = pack_bucket([("q", q), ("n", n), ("b", b)])
    views = packed_views(buf, layout)
    params = {"pq": torch.zeros(4, 256, dtype=q.dtype), "pn": torch.zeros(1024, dtype=torch.bfloat16),
              "pb": torch.zeros(64)}
    rec = WriteRecorder(params, backup=False)
    for name, v in views.items():
        rec.add_source(v, name, "data" if v.dtype == q.dtype else "plain")
    with rec:
        params["pq"].copy_(views["q"][8:12])          # bytes [2048, 3072): n's bf16 elements [2048, 3072)
        params["pn"].copy_(views["n"])
        params["pb"].copy_(views["b"])
    got = [(w.source, w.param, w.src_box) for w in rec.writes]
    assert got == [("q", "pq", ((8, 4), (0, 256))), ("n", "pn", ((0, 1024),)), ("b", "pb", ((0, 64),))]


def test_recorder_picks_the_innermost_of_nested_sources_and_skips_dead_ones():
    """Nested views of one storage (a fused tensor and its per-expert slices): a write from inside a
    slice is the slice's; from the fused tensor outside every live slice, the fused tensor's; a dead
    slice's range falls back to the enclosing source."""
    fused = torch.randn(4, 8, 32)
    params = {"p": torch.zeros(8, 32)}
    rec = WriteRecorder(params, backup=False)
    rec.add_source(fused, "fused", "plain")
    experts = [fused[i] for i in range(4)]
    for i, e in enumerate(experts):
        rec.add_source(e, f"expert{i}", "plain")
    top = fused[1, :4]                                               # nested twice, same start as expert1
    rec.add_source(top, "expert1.top", "plain")
    assert rec.source_of(fused[2, 3:5]).name == "expert2"
    assert rec.source_of(fused[1, :2]).name == "expert1.top"
    assert rec.source_of(fused[1, 5:]).name == "expert1"
    assert rec.source_of(fused[1:3]).name == "fused"                 # spans two experts
    del experts[3], e
    import gc
    gc.collect()
    assert rec.source_of(fused[3]).name == "fused"                   # expert3's view died
    assert rec.source_of(torch.randn(3)) is None
