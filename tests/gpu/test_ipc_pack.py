"""The packed CUDA IPC bucket across processes: an engine-side process maps the trainer's staging
buffer with the one handle, reads every tensor byte for byte, and a second bucket staged into the
same (reused) buffer reads as the second bucket.  The unpacked form (one handle per tensor) too."""

import json

import pytest
import torch
import torch.multiprocessing as mp

from mxfp8_learner_grid.common import quantize_rows
from mxfp8_learner_grid.common.sync.transport import Stager, read_source

pytestmark = pytest.mark.gpu


def _engine(q_in, q_out):
    torch.cuda.set_device(0)
    while (src := q_in.get()) is not None:
        tensors = read_source(src, "cuda:0")
        q_out.put({n: (str(t.dtype), list(t.shape), t.contiguous().view(torch.uint8).cpu().tolist())
                   for n, t in tensors.items()})
        del tensors
        torch.cuda.synchronize()


def _bucket(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, s = quantize_rows(torch.randn(64, 128, device="cuda", generator=g))
    return [("a.weight", q.view(torch.float8_e4m3fn)), ("a.weight_scale_inv", s),
            ("norm.weight", torch.randn(33, device="cuda", generator=g).to(torch.bfloat16)),
            ("t.weight", torch.randn(8, 6, device="cuda", generator=g).t())]          # not contiguous


@pytest.mark.parametrize("staging", ["cuda_ipc", "cuda_ipc_tensors"])
def test_ipc_bucket_reads_byte_for_byte_in_another_process(staging):
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_engine, args=(q_in, q_out), daemon=True)
    proc.start()
    try:
        st = Stager(staging)
        ptrs = []
        for seed in (0, 1):
            bucket = _bucket(seed)
            src = st.stage(bucket)
            json.dumps(src)                                   # it travels as JSON
            if staging == "cuda_ipc":
                assert set(src) == {"kind", "buffer", "tensors"}
                ptrs.append(st._buffer.data_ptr())
            q_in.put(src)
            got = q_out.get(timeout=120)
            st.release(src)
            for name, t in bucket:
                dtype, shape, data = got[name]
                assert dtype == str(t.dtype) and shape == list(t.shape), name
                assert data == t.contiguous().view(torch.uint8).cpu().tolist(), (seed, name)
        if staging == "cuda_ipc":
            assert ptrs[0] == ptrs[1]                          # the staging buffer was reused
    finally:
        q_in.put(None)
        proc.join(60)
