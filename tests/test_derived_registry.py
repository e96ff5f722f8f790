"""The derived-tensor registry (common/sync/derived.py): a rebuild compared with the live tensor
bit for bit on its own device, one synchronization per registry, names in registration order."""

import pytest
import torch

from mxfp8_learner_grid.common.sync import derived as derived_mod
from mxfp8_learner_grid.common.sync.derived import DerivedRegistry, differs, read_flags

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _reg(entries):
    """A registry of ("owner", name) -> (live, builder) in the given order."""
    reg = DerivedRegistry()
    for name, (live, build) in entries:
        reg.register("layer", name, live, build)
    return reg


def _copy_builder(src):
    return lambda: src.clone()


@pytest.mark.parametrize("device", DEVICES)
def test_equal_is_not_stale(device):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w_int32": torch.randint(-2**31, 2**31 - 1, (64, 48), generator=g, dtype=torch.int32),
        "w_bf16": torch.randn(32, 64, generator=g).to(torch.bfloat16),
        "w_fp8": torch.randn(16, 32, generator=g).to(torch.float8_e4m3fn),
        "w_fp32": torch.randn(7, 5, generator=g),
        "flags_bool": torch.rand(9, generator=g) > 0.5,
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.5),
    }
    tensors = {k: v.to(device) for k, v in tensors.items()}
    reg = _reg([(k, (v, _copy_builder(v))) for k, v in tensors.items()])
    assert reg.stale() == []
    assert all(not d.stale() for d in reg)


@pytest.mark.parametrize("device", DEVICES)
def test_one_byte_in_the_middle_of_a_large_tensor(device):
    live = torch.randint(-2**31, 2**31 - 1, (1024, 1024), generator=torch.Generator().manual_seed(1),
                         dtype=torch.int32).to(device)
    built = live.clone()
    built.view(torch.uint8).view(-1)[built.numel() * 2 + 1] ^= 0x01      # one bit of one byte, mid-tensor
    reg = _reg([("before", (live.clone(), _copy_builder(live))),
                ("w", (live, _copy_builder(built))),
                ("after", (live.clone(), _copy_builder(live)))])
    assert reg.stale() == ["layer.w"]
    assert reg.entries[("layer", "w")].stale() is True
    assert reg.entries[("layer", "before")].stale() is False


@pytest.mark.parametrize("device", DEVICES)
def test_nan_payload_counts(device):
    live = torch.zeros(8, dtype=torch.float32, device=device)
    live.view(torch.int32)[3] = 0x7FC00000              # the canonical quiet NaN
    built = live.clone()
    built.view(torch.int32)[3] = 0x7FC00001             # a NaN with another payload
    assert torch.isnan(live[3]) and torch.isnan(built[3])
    reg = _reg([("w", (live, _copy_builder(built)))])
    assert reg.stale() == ["layer.w"]
    # the same NaN bits are not stale (a value comparison would call NaN != NaN)
    assert _reg([("w", (live, _copy_builder(live)))]).stale() == []


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_negative_zero_counts(device, dtype):
    live = torch.zeros(16, dtype=dtype, device=device)
    built = live.clone()
    built[5] = -0.0
    assert torch.equal(live, built)                     # equal as values ...
    assert _reg([("w", (live, _copy_builder(built)))]).stale() == ["layer.w"]   # ... not as bytes


@pytest.mark.parametrize("device", DEVICES)
def test_shape_mismatch_is_stale_not_a_crash(device):
    live = torch.arange(12, dtype=torch.int32, device=device).reshape(3, 4)
    reg = _reg([("same_bytes_other_shape", (live, lambda: live.reshape(4, 3).clone())),
                ("fewer", (live.clone(), lambda: live[:2].clone())),
                ("ok", (live.clone(), _copy_builder(live)))])
    assert reg.stale() == ["layer.same_bytes_other_shape", "layer.fewer"]


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_live_tensor(device):
    base = torch.randn(64, 96, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(device)
    live = base.t()                                     # transposed view: not contiguous
    sliced = base[:, ::3]                               # strided columns
    assert not live.is_contiguous() and not sliced.is_contiguous()
    reg = _reg([("t", (live, lambda: base.t().contiguous())),
                ("s", (sliced, lambda: base[:, ::3].contiguous()))])
    assert reg.stale() == []
    changed = base.t().contiguous()
    changed[10, 20] = -changed[10, 20]                  # the sign bit flips (even of a zero)
    assert _reg([("t", (live, lambda: changed.clone()))]).stale() == ["layer.t"]
    # non-contiguous rebuild against a contiguous live tensor too
    assert _reg([("r", (base.t().contiguous(), lambda: base.t()))]).stale() == []


@pytest.mark.parametrize("device", DEVICES)
def test_order_of_names_preserved(device):
    names = [f"m{i:02d}" for i in range(20)]
    stale_ones = {"m17", "m02", "m11", "m00", "m19"}
    entries = []
    for i, n in enumerate(names):
        live = torch.full((4, 4), i, dtype=torch.int16, device=device)
        other = live.clone()
        if n in stale_ones:
            other[0, 0] += 1
        entries.append((n, (live, _copy_builder(other))))
    reg = _reg(entries)
    assert reg.stale() == [f"layer.{n}" for n in names if n in stale_ones]


def test_builder_dtype_and_device_converted_like_refresh():
    """A rebuild of another dtype is stored by the kernels' refresh through ``copy_``: compared
    after the same conversion."""
    live = torch.tensor([1.0, 2.5, -3.0], dtype=torch.bfloat16)
    assert _reg([("w", (live, lambda: live.float()))]).stale() == []
    assert _reg([("w", (live, lambda: torch.tensor([1.0, 2.5, -3.5])))]).stale() == ["layer.w"]


def test_one_sync_per_registry(monkeypatch):
    """The registry reads all flags with one stack(...).tolist() per device, not one per entry."""
    reads = []
    real = derived_mod.read_flags

    def counting(flags):
        reads.append(len(flags))
        return real(flags)

    monkeypatch.setattr(derived_mod, "read_flags", counting)
    reg = _reg([(f"w{i}", (torch.full((3,), i), _copy_builder(torch.full((3,), i + (i == 4))))) for i in range(10)])
    assert reg.stale() == ["layer.w4"]
    assert reads == [10]


def test_flags_helpers():
    a = torch.arange(6, dtype=torch.int64)
    assert differs(a, a.reshape(2, 3)) is True
    assert differs(a, a.clone()) is False and differs(a, a + 1) is True     # on the CPU: decided at once
    # flags still on a device (0-dim bool tensors) are read together, in order, mixed with decided ones
    f, t = torch.tensor(False), torch.tensor(True)
    assert read_flags([True, f, False, t, f]) == [True, False, False, True, False]
    if torch.cuda.is_available():
        g = differs(a.cuda(), a.cuda().clone())
        assert isinstance(g, torch.Tensor) and g.dim() == 0 and g.dtype == torch.bool and g.is_cuda
        assert read_flags([g, differs(a.cuda(), a.cuda() + 1), f, t]) == [False, True, False, True]
    assert read_flags([]) == []
    c = torch.tensor([complex(1.0, 2.0), complex(0.0, 0.0)], dtype=torch.complex128)   # no 16-byte integer: compared as bytes
    c2 = c.clone()
    c2[1] = complex(0.0, -0.0)
    assert read_flags([differs(c, c.clone()), differs(c, c2)]) == [False, True]


@pytest.mark.parametrize("device", DEVICES)
def test_engine_as_found_reads_all_regions_at_once(device):
    """``engine_as_found`` (checks.py) compares every written region's old bytes with the new ones
    through the same flags: regions named in write order, -0 / NaN payloads count, bool params work."""
    from types import SimpleNamespace

    from mxfp8_learner_grid.common.sync.checks import engine_as_found
    from mxfp8_learner_grid.common.sync.recorder import Write

    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.zeros(4, 8, device=device), requires_grad=False)
    model.b = torch.nn.Parameter(torch.arange(16, dtype=torch.int32, device=device).reshape(2, 8), requires_grad=False)
    model.m = torch.nn.Parameter(torch.ones(6, dtype=torch.bool, device=device), requires_grad=False)
    old_a = model.a.detach().clone().cpu()
    old_a[1, 2] = -0.0                                  # value-equal, byte-different: only in rows 0..1
    old_b = model.b.detach().clone().cpu()
    old_b[1, 7] += 1                                    # differs in row 1
    old_m = model.m.detach().clone().cpu()
    writes = [Write("A.top", "data", None, "a", ((0, 2), (0, 8))),      # holds the -0: bad
              Write("A.bottom", "data", None, "a", ((2, 2), (0, 8))),   # equal
              Write("B.row0", "plain", None, "b", ((0, 1), (0, 8))),    # equal
              Write("B.row1", "plain", None, "b", ((1, 1), (0, 8))),    # bad
              Write("M", "plain", None, "m", ((0, 6),)),                # bool, equal
              Write("X", "plain", None, "a", None)]                     # not a box: skipped
    s = SimpleNamespace(adapter=SimpleNamespace(model=lambda: model, rank=0), stale_before=[],
                        recorder=SimpleNamespace(writes=writes, backups={"a": old_a, "b": old_b, "m": old_m}),
                        manifest=SimpleNamespace(kv_scales=None), kv_before={})
    res = engine_as_found(s)
    assert res.ok is False
    assert [d.split(" ")[0] for d in res.details] == ["A.top", "B.row1"]
    s.recorder.backups = {"a": model.a.detach().clone().cpu(), "b": model.b.detach().clone().cpu(), "m": old_m}
    res = engine_as_found(s)
    assert res.ok is True and "held exactly the learner's bytes" in res.details[0]
