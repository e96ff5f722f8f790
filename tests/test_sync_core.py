"""The engine-agnostic sync pieces (common/sync): fingerprints, boxes, manifest validation,
the write recorder and a full session on a plain PyTorch model (no engine)."""

import asyncio


import pytest
import torch

from mxfp8_learner_grid.common import quantize_rows
from mxfp8_learner_grid.common.sync.digest import fingerprint
from mxfp8_learner_grid.common.sync.manifest import Manifest, validate
from mxfp8_learner_grid.common.sync.recorder import UpdateRejected, WriteRecorder
from mxfp8_learner_grid.common.sync.regions import coverage_problems, slice_box, view_box
from mxfp8_learner_grid.common.sync.session import EngineAdapter, UpdateSession, fingerprint_regions


def test_fingerprint_properties():
    a = torch.randint(0, 256, (100, 96), dtype=torch.uint8)
    f = fingerprint(a)
    b = a.clone()
    b[7, 3] ^= 0x10
    assert fingerprint(b) != f                                      # one byte
    c = a.clone()
    c[[4, 5]] = a[[5, 4]]
    assert fingerprint(c) != f                                      # swapped rows
    assert fingerprint(a.view(torch.float8_e4m3fn)) == f            # bytes, not dtype
    assert fingerprint(a[:, :32]) == fingerprint(a[:, :32].contiguous())
    assert fingerprint(a[:-1]) != f                                 # length


def test_view_boxes_and_coverage():
    p = torch.zeros(4, 6, 8)
    v = p[2].narrow(0, 1, 3).narrow(1, 4, 4)
    box = view_box(v, p.shape)
    assert box == ((2, 1), (1, 3), (4, 4))
    assert torch.equal(slice_box(p, box).reshape(3, 4), v)
    assert view_box(p.transpose(0, 1), p.shape) is None
    full = [((0, 4), (0, 6), (0, 8))]
    assert coverage_problems(full, p.shape) == []
    halves = [((0, 2), (0, 6), (0, 8)), ((2, 2), (0, 6), (0, 8))]
    assert coverage_problems(halves, p.shape) == []
    assert "written twice" in coverage_problems(halves + [((1, 1), (0, 6), (0, 8))], p.shape)[0]
    assert "never written" in coverage_problems(halves[:1], p.shape)[0]


def test_manifest_validation_names_every_problem():
    sig = {"a.weight": ((64, 96), True), "norm.weight": ((96,), False)}
    dt = {"norm.weight": torch.float32}
    q, s = quantize_rows(torch.randn(64, 96))
    ok = Manifest.of({"a.weight": q, "a.weight_scale_inv": s, "norm.weight": torch.ones(96)}, 1, "mxfp8")
    assert validate(ok, sig, dt) == []
    assert validate(Manifest.of({"a.weight": torch.randn(64, 96), "norm.weight": torch.ones(96)}, 1, "bf16"),
                    sig, dt) == []
    bad = Manifest.of({"a.weight": q, "a.weight_scale_inv": torch.zeros(128, 4, dtype=torch.uint8),
                       "norm.weight": torch.ones(96, dtype=torch.bfloat16), "x.weight": torch.ones(1)}, 1, "mxfp8")
    probs = " | ".join(validate(bad, sig, dt))
    assert "TE padding not stripped" in probs and "x.weight: unknown tensor" in probs
    assert "norm.weight: dtype torch.bfloat16; the engine holds it as torch.float32" in probs
    missing = Manifest.of({"a.weight": q}, 1, "mxfp8")
    probs = " | ".join(validate(missing, sig, dt))
    assert "a.weight: on-grid weight has no 'weight_scale_inv' tensor" in probs and "full update misses 1 tensors" in probs
    assert validate(Manifest.of({"a.weight": q, "a.weight_scale_inv": s}, 1, "mxfp8", partial=True), sig, dt) == []
    m2 = Manifest.from_json(ok.to_json())
    assert m2.tensors[0].name == "a.weight" and m2.format == "mxfp8"


class TinyAdapter(EngineAdapter):
    """A plain PyTorch 'engine': params written by name, the layout is the identity."""

    def __init__(self):
        self.m = torch.nn.Linear(96, 64, bias=False)
        self.m.weight.data.zero_()

    def model(self):
        return self.m

    def load(self, named):
        for n, t in named:
            if n == "weight":
                self.m.weight.data.copy_(t)

    def signature(self):
        return {"weight": ((64, 96), False)}, {"weight": torch.float32}, set()

    def scope(self, touched):
        return dict(self.m.named_parameters())


def test_session_on_a_plain_model():
    ad = TinyAdapter()
    w = torch.randn(64, 96)
    s = UpdateSession(ad, Manifest.of({"weight": w}, 3, "bf16"), digest="full")
    s.load([("weight", w)])
    rep = s.finish()
    assert not rep.failed(), rep.summary()
    assert fingerprint_regions(lambda n, r: w, rep.extra["regions"]) == []
    assert fingerprint_regions(lambda n, r: w + 1, rep.extra["regions"])           # different bytes are seen
    assert s.commit(True) and ad.version == 3 and torch.equal(ad.m.weight.data, w)
    # a NaN update is refused mid-load and rolled back to the previous bytes
    s2 = UpdateSession(ad, Manifest.of({"weight": w}, 4, "bf16"))
    bad = w.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(UpdateRejected, match="weight: holds NaN"):
        s2.load([("weight", bad)])
    assert torch.equal(ad.m.weight.data, w) and ad.version == 3
    with pytest.raises(UpdateRejected, match="already failed"):
        s2.load([("weight", w)])


def test_recorder_refuses_silent_casts():
    p = torch.zeros(4, 32)
    rec = WriteRecorder({"p": p})
    src = torch.ones(4, 32, dtype=torch.float64)
    rec.add_source(src, "p.src", "plain")
    with rec, pytest.raises(UpdateRejected, match="would be cast"):
        p.copy_(src)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_recorder_content_checks_are_read_once_at_exit_in_write_order(device):
    """NaN fp8 codes, E8M0 scale 255 and non-finite floats are queued on the device while the loaders
    copy and read once when the recorder exits: the first bad write (in write order) is named; a
    bucket with no bad tensor passes; an error already in flight is not masked by them."""
    q, sc = quantize_rows(torch.randn(8, 64))
    params = {"w": torch.zeros(8, 64, dtype=q.dtype, device=device), "s": torch.zeros(8, 2, dtype=torch.uint8,
                                                                                         device=device),
              "b": torch.zeros(8, device=device)}

    def run(qs, ss, bs):
        rec = WriteRecorder(params, backup=False)
        rec.add_source(qs, "w.q", "data")
        rec.add_source(ss, "w.s", "scale")
        rec.add_source(bs, "b.src", "plain")
        with rec:
            params["b"].copy_(bs)
            params["w"].copy_(qs)
            params["s"].copy_(ss)
        return rec
    good = (q.to(device), sc.to(device), torch.ones(8, device=device))
    assert len(run(*good).writes) == 3
    nan_q = q.view(torch.uint8).clone()
    nan_q[3, 5] = 0xFF
    bad_s = sc.clone()
    bad_s[7, 1] = 255
    inf_b = torch.ones(8)
    inf_b[2] = float("inf")
    with pytest.raises(UpdateRejected, match="w.q: fp8 weight holds NaN codes"):
        run(nan_q.view(q.dtype).to(device), bad_s.to(device), good[2])          # both bad: the first write named
    with pytest.raises(UpdateRejected, match="w.s: E8M0 scale 255"):
        run(good[0], bad_s.to(device), good[2])
    with pytest.raises(UpdateRejected, match="b.src: holds NaN or Inf"):
        run(good[0], bad_s.to(device), inf_b.to(device))                       # write order: b first
    rec = WriteRecorder(params, backup=False)
    inf_dev = inf_b.to(device)
    rec.add_source(inf_dev, "b.src", "plain")
    with pytest.raises(KeyError):          # an error in flight wins; the queued checks are dropped, not raised
        with rec:
            params["b"].copy_(inf_dev)
            raise KeyError("in flight")
    assert rec._pending == []


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("chunk", [64 << 20, 100])
def test_bucket_content_checks_name_the_first_bad_tensor_before_any_write(device, chunk, monkeypatch):
    """check_contents tests a whole bucket in a few launches (pieces of at most CHECK_CHUNK_BYTES): a clean
    bucket passes; otherwise the first tensor in bucket order that breaks a rule is named, whatever the rule
    and whichever piece it landed in; tensors without a rule (ints) and empty ones pass."""
    from mxfp8_learner_grid.common.sync import recorder as R
    monkeypatch.setattr(R, "CHECK_CHUNK_BYTES", chunk)
    q, sc = quantize_rows(torch.randn(16, 128))
    good = [("a.weight", q, "data"), ("a.weight_scale_inv", sc, "scale"), ("norm.weight", torch.ones(64), "plain"),
            ("b.weight", q[8:], "data"), ("ids", torch.arange(5), "plain"), ("empty", torch.ones(0), "plain"),
            ("half", torch.ones(8, dtype=torch.bfloat16), "plain")]
    good = [(n, t.to(device), r) for n, t, r in good]
    R.check_contents(good)

    def spoiled(i, fn):
        out = list(good)
        t = out[i][1].clone()
        fn(t)
        out[i] = (out[i][0], t, out[i][2])
        return out

    def nan_code(t):
        t.view(torch.uint8)[1, 3] = 0x7F

    def scale_255(t):
        t[2, 1] = 255

    def inf(t):
        t[-1] = float("inf")
    cases = [(3, nan_code, "b.weight: fp8 weight holds NaN codes"), (1, scale_255, "a.weight_scale_inv: E8M0 scale 255"),
             (2, inf, "norm.weight: holds NaN or Inf"), (6, inf, "half: holds NaN or Inf")]
    for i, fn, words in cases:
        with pytest.raises(UpdateRejected, match=words):
            R.check_contents(spoiled(i, fn))
    both = spoiled(3, nan_code)
    t = both[2][1].clone()
    t[0] = float("nan")
    both[2] = (both[2][0], t, "plain")
    with pytest.raises(UpdateRejected, match="norm.weight: holds NaN"):     # bucket order: norm.weight first
        R.check_contents(both)
    # a "scale" rule only for scale-role uint8; an fp8 tensor in any role is checked for NaN codes
    R.check_contents([("x", torch.full((4,), 255, dtype=torch.uint8, device=device), "plain")])


def test_checked_sources_and_their_quantized_bytes_are_not_rechecked_per_write():
    """A source registered checked=True (its bucket passed check_contents) is not re-tested at each write,
    nor are bytes a loader quantized from it (note_derived_source inherits the mark); an unchecked source
    still is.  The mark is sound because the grid quantizer never makes NaN codes or scale 255 from finite
    values, checked here at the extremes of bf16 and fp32."""
    from mxfp8_learner_grid.common.sync.recorder import note_derived_source
    ext = torch.tensor([3.3895e38, -3.3895e38, 1e-38, -1e-45, 0.0, -0.0, 448.0, 464.0, 1e30, 2.0 ** -126] * 16)
    for x in (ext.reshape(5, 32), ext.to(torch.bfloat16).reshape(5, 32), torch.zeros(2, 32)):
        q, s = quantize_rows(x)
        assert not ((q.view(torch.uint8) & 0x7F) == 0x7F).any() and not (s == 255).any()
    params = {"w": torch.zeros(8, 64, dtype=torch.float8_e4m3fn), "s": torch.zeros(8, 2, dtype=torch.uint8)}
    src = torch.randn(8, 64)
    rec = WriteRecorder(params, backup=False)
    rec.add_source(src, "w", "plain", checked=True)
    with rec:
        q, s = quantize_rows(src)
        note_derived_source(q, src, "data")
        note_derived_source(s, src, "scale")
        params["w"].copy_(q)
        params["s"].copy_(s)
        assert rec._pending == []
    assert [(w.source, w.role) for w in rec.writes] == [("w", "data"), ("w", "scale")]
    rec = WriteRecorder(params, backup=False)
    rec.add_source(src, "w", "plain")
    with pytest.raises(UpdateRejected, match="w: fp8 weight holds NaN codes"):
        with rec:
            q, s = quantize_rows(src)
            q.view(torch.uint8)[0, 0] = 0xFF
            note_derived_source(q, src, "data")
            params["w"].copy_(q)
            assert len(rec._pending) == 1


def test_middleware_is_off_by_default(monkeypatch):
    from mxfp8_learner_grid.vllm_plugin import http  # noqa: F401 (imports vllm only for its package)
    monkeypatch.delenv("MXFP8_GRID_UPDATES", raising=False)
    sent = []

    async def inner(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def receive():
        return {"body": b"{}", "more_body": False}

    async def send(msg):
        sent.append(msg)
    mw = http.GridUpdateMiddleware(inner)
    asyncio.run(mw({"type": "http", "path": "/grid/rpc", "method": "POST", "app": None}, receive, send))
    assert sent[0]["status"] == 404 and b"off" in sent[1]["body"]
    sent.clear()
    asyncio.run(mw({"type": "http", "path": "/v1/models", "method": "GET"}, receive, send))
    assert (b"x-weight-version", b"0") in sent[0]["headers"]





def test_device_backup_and_digest_off():
    ad = TinyAdapter()
    w = torch.randn(64, 96)
    s = UpdateSession(ad, Manifest.of({"weight": w}, 1, "bf16"), backup="device", digest="off")
    s.load([("weight", w)])
    rep = s.finish()
    assert not rep.failed() and rep.extra["regions"] == [] and s.commit(True)
    s2 = UpdateSession(ad, Manifest.of({"weight": w}, 2, "bf16"), backup="device")
    s2.load([("weight", w * 2)])
    assert s2.recorder.backups["weight"].device == w.device
    chk = s2.abort()
    assert chk.ok and torch.equal(ad.m.weight.data, w) and ad.version == 1
    with pytest.raises(ValueError, match="backup must be"):
        UpdateSession(ad, Manifest.of({"weight": w}, 3, "bf16"), backup="disk")


class _PipeGroup:
    """Stands in for an NCCL communicator: rank 0's broadcasts arrive, in order, at the other end.
    The queue holds one tensor, so a client that did not send while the load RPC receives deadlocks."""

    def __init__(self, q, me):
        self.q, self.me = q, me

    def broadcast(self, t, src=0, stream=None):
        if self.me == 0:
            self.q.put(t.clone(), timeout=10)
        else:
            t.copy_(self.q.get(timeout=10))


class _OneRankTransport:
    """A trainer<->engine transport over the engine-agnostic session, with an NCCL-like push."""

    def __init__(self, adapter):
        import queue
        from mxfp8_learner_grid.common.sync.transport import nccl_send, nccl_source, read_source
        q = queue.Queue(maxsize=1)
        self.trainer, self.worker = _PipeGroup(q, 0), _PipeGroup(q, 1)
        self.ad, self.session = adapter, None
        self._src, self._send, self._read = nccl_source, nccl_send, read_source

    def stage(self, bucket):
        return self._src(bucket)

    def send(self, bucket, source):
        self._send(self.trainer, bucket)

    def release(self, source):
        pass

    def pause(self):
        pass

    resume = reset_prefix_cache = pause

    def rpc(self, method, *args):
        import dataclasses
        import json
        if method == "grid_state":
            return [{"rank": 0, "version": self.ad.version, "torn": False}]
        if method == "grid_update_begin":
            opts = json.loads(args[1])
            self.session = UpdateSession(self.ad, Manifest.from_json(args[0]), backup=opts["backup"],
                                         digest=opts["digest"])
            return [{}]
        if method == "grid_update_load":
            self.session.load(self._read(args[0], "cpu", nccl=self.worker).items())
            return [{}]
        if method == "grid_update_finish":
            return [dataclasses.asdict(self.session.finish())]
        if method == "grid_update_commit":
            return [{"applied": self.session.commit(args[0] == "1"), "version": self.ad.version, "rank": 0}]
        if method == "grid_update_abort":
            return [{"check": dataclasses.asdict(self.session.abort())}]
        raise AssertionError(method)


def test_client_pushes_nccl_buckets_while_the_engine_receives():
    from mxfp8_learner_grid.common.sync.client import GridSyncClient
    from mxfp8_learner_grid.common.sync.transport import nccl_source
    ad = TinyAdapter()
    ad.version = 0
    client = GridSyncClient(_OneRankTransport(ad), digest="full", bucket_bytes=1)
    w = torch.randn(64, 96)
    rep = client.update_weights({"weight": w}, format="bf16", version=5)
    assert rep.ok, rep.summary()
    assert torch.equal(ad.m.weight.data, w) and ad.version == 5
    assert nccl_source([("weight", w)]) == {"kind": "nccl", "tensors": [["weight", "float32", [64, 96]]]}
    # a NaN tensor: received, then refused by the session; the engine keeps version 5's bytes
    rep = client.update_weights({"weight": torch.randn(64, 96) * float("nan")}, format="bf16", version=6)
    assert not rep.applied and "NaN" in (rep.error or "") and torch.equal(ad.m.weight.data, w) and ad.version == 5
    # a replayed (older) update is refused before any write, naming both versions; the same version again
    # (a verification pass, a retry) and newer ones go through
    rep = client.update_weights({"weight": torch.randn(64, 96)}, format="bf16", version=4)
    assert not rep.applied and "version 4 is older than the version this rank serves (5)" in (rep.error or ""), \
        rep.summary()
    assert torch.equal(ad.m.weight.data, w) and ad.version == 5
    w7 = torch.randn(64, 96)
    assert client.update_weights({"weight": w}, format="bf16", version=5).ok
    assert client.update_weights({"weight": w7}, format="bf16", version=7).ok and ad.version == 7


def test_sources_that_share_a_storage_keep_their_names():
    """transformers 5 exports fused experts as slices of one tensor; CUDA IPC rebuilds slices of
    one buffer: each slice is its own learner tensor, and writes from it are attributed to it."""
    fused = torch.randn(2, 8, 32)
    p = torch.zeros(2, 8, 32)
    rec = WriteRecorder({"p": p}, backup=False)
    e0, e1 = fused[0], fused[1]                 # the learner's tensors (alive while they are loaded)
    rec.add_source(e0, "experts.0.w", "plain")
    rec.add_source(e1, "experts.1.w", "plain")
    with rec:
        p[1].copy_(e1)
        p[0].copy_(e0)
        p[0, :4].copy_(e0[4:])                   # a sub-box of expert 0's tensor
    assert [(w.source, w.dest_box, w.src_box) for w in rec.writes] == [      # boxes: (start, length) per dim
        ("experts.1.w", ((1, 1), (0, 8), (0, 32)), ((0, 8), (0, 32))),
        ("experts.0.w", ((0, 1), (0, 8), (0, 32)), ((0, 8), (0, 32))),
        ("experts.0.w", ((0, 1), (0, 4), (0, 32)), ((4, 4), (0, 32)))]


def test_kv_scales_roll_back_with_the_weights():
    class KVAdapter(TinyAdapter):
        def __init__(self):
            super().__init__()
            self.kv = {0: (1.0, 2.0)}

        def set_kv_scales(self, scales):
            for k, (a, b) in scales.items():
                self.kv[int(k)] = (float(a), float(b))
            return []

        def kv_scale_values(self):
            return dict(self.kv)
    ad = KVAdapter()
    w = torch.randn(64, 96)
    m = Manifest.of({"weight": w}, 1, "bf16", kv_scales={"0": [0.5, 0.25]})
    s = UpdateSession(ad, m)
    s.load([("weight", w)])
    rep = s.finish()
    assert not rep.failed() and ad.kv[0] == (0.5, 0.25)
    assert not s.commit(False)                    # the client rejects it: weights and KV scales roll back
    assert ad.kv[0] == (1.0, 2.0) and torch.equal(ad.m.weight.data, torch.zeros(64, 96))


def test_kv_scales_are_moot_for_an_engine_whose_kv_cache_reads_none():
    """A BF16 KV cache reads no scales: a trainer that sends them anyway is not refused (the
    check says why it did not compare), while an FP8 cache without them is a failure."""
    class NoKV(TinyAdapter):
        used = False

        def kv_scales_used(self):
            return self.used

        def set_kv_scales(self, scales):      # nowhere to put them (SGLang with a BF16 cache)
            return []
    for used, ok in ((False, True), (True, False)):
        ad = NoKV()
        ad.used = used
        w = torch.randn(64, 96)
        s = UpdateSession(ad, Manifest.of({"weight": w}, 1, "bf16", kv_scales={"0": [0.5, 0.25]}))
        s.load([("weight", w)])
        rep = s.finish()
        kv = rep.check("cache_coherence")[0]
        assert kv.ok is ok, rep.summary()
        assert ("not used" in " ".join(kv.details)) is (not used)


def test_a_failure_after_the_commit_reports_the_update_applied():
    from mxfp8_learner_grid.common.sync.client import GridSyncClient
    ad = TinyAdapter()
    ad.version = 0
    t = _OneRankTransport(ad)

    def broken_flush():
        raise RuntimeError("flush_cache refused")
    t.reset_prefix_cache = broken_flush
    w = torch.randn(64, 96)
    rep = GridSyncClient(t).update_weights({"weight": w}, format="bf16", version=3)
    assert rep.applied and not rep.rolled_back and not rep.ok and ad.version == 3
    assert "cache_coherence" in rep.failed() and torch.equal(ad.m.weight.data, w)


def test_a_freed_source_does_not_claim_its_reused_memory():
    """Bucket tensors die after their bucket; the allocator hands their memory to the next ones.
    A stale registration must not attribute a later write to the dead tensor's name."""
    p = torch.zeros(4, 32)
    rec = WriteRecorder({"p": p}, backup=False)
    t = torch.randn(4, 32)
    rec.add_source(t, "old", "plain")
    del t                                          # its registration is now dead
    t2 = torch.randn(4, 32)
    rec.add_source(t2, "new", "plain")
    with rec:
        p.copy_(t2)
    assert [w.source for w in rec.writes] == ["new"]
    dead = [x for st in rec._sources.values() for x in st.by_range.values() if x.ref() is None]
    assert not dead or all(x.name == "old" for x in dead)


@pytest.mark.parametrize("payload,needle", [
    ("[1, 2]", "a manifest is an object"),
    ('{"version": 1, "format": "bf16", "tensors": [], "evil": 1}', "unknown keys ['evil']"),
    ('{"version": "7", "format": "bf16"}', "version must be an integer"),
    ('{"version": true, "format": "bf16"}', "version must be an integer"),
    ('{"version": 100000000000000000000000000000000000000, "format": "bf16"}', "version must be an integer"),
    ('{"version": -1, "format": "bf16"}', "version must be an integer"),
    ('{"version": 1, "format": "fp4"}', "format must be one of"),
    ('{"version": 1, "format": "bf16", "partial": "yes"}', "partial must be true or false"),
    ('{"version": 1, "format": "bf16", "kv_scales": [1]}', "kv_scales must be an object"),
    ('{"version": 1, "format": "bf16", "tensors": {"a": 1}}', "tensors must be a list"),
    ('{"version": 1, "format": "bf16", "tensors": [{"name": "w"}]}', "tensor #0 must be an object"),
    ('{"version": 1, "format": "bf16", "tensors": [{"name": 3, "shape": [2], "dtype": "torch.bfloat16"}]}',
     "tensor #0: name must be"),
    ('{"version": 1, "format": "bf16", "tensors": [{"name": "w", "shape": [1000000000000000], "dtype": "torch.bfloat16"}]}',
     "'w': shape must be"),
    ('{"version": 1, "format": "bf16", "tensors": [{"name": "w", "shape": [2.5], "dtype": "torch.bfloat16"}]}',
     "'w': shape must be"),
    ('{"version": 1, "format": "bf16", "tensors": [{"name": "w", "shape": [2], "dtype": 5}]}', "'w': dtype must be"),
])
def test_malformed_manifests_are_refused_naming_the_field(payload, needle):
    """Untrusted manifests (HTTP, SGLang's bridge): wrong types, huge numbers, unknown keys -- a
    ValueError naming the field or tensor, cut short, never a TypeError from deep inside."""
    from mxfp8_learner_grid.common.sync.manifest import Manifest
    with pytest.raises(ValueError) as e:
        Manifest.from_json(payload)
    assert needle in str(e.value) and len(str(e.value)) < 300, str(e.value)
    m = Manifest.of({"w": torch.zeros(2, 3)}, 4, "bf16", partial=True, kv_scales={"0": [0.1, 0.2]})
    assert Manifest.from_json(m.to_json()) == m


def test_protocol_checks_calls_and_maps_errors(monkeypatch, tmp_path):
    """Request validation and the error -> status mapping both plugins' routes use (common/sync/protocol.py)."""
    from mxfp8_learner_grid.common.sync.protocol import BadRequest, check_call, error_reply, raise_error
    from mxfp8_learner_grid.common.sync.security import Refused
    monkeypatch.setenv("MXFP8_GRID_STAGING_DIRS", str(tmp_path))
    f = tmp_path / "b.safetensors"
    f.write_bytes(b"x")
    assert check_call({"method": "grid_update_load", "args": [f'{{"kind": "safetensors", "path": "{f}"}}']})[0] \
        == "grid_update_load"
    for body, status, needle in (([1], 400, "body must be"), ({"method": "grid_x"}, 400, "not a grid update method"),
                                 ({"method": "grid_state", "args": [1]}, 400, "list of strings"),
                                 ({"method": "grid_update_load", "args": ['{"kind": "safetensors", "path": "/etc/x"}']},
                                  400, "must be inside"),
                                 ({"method": "grid_nccl_init", "args": ['{"host": "203.0.113.7"}']}, 403, "203.0.113.7"),
                                 ({"method": "grid_update_begin", "args": ["{no"]}, 400, "manifest is not JSON")):
        with pytest.raises(BadRequest, match=needle) as exc:
            check_call(body)
        assert exc.value.status == status
    assert error_reply(Refused("no")) == (403, {"error": "no"})
    status, body = error_reply(UpdateRejected("bad", {"layout": ["x"]}))
    assert status == 422 and body["problems"] == {"layout": ["x"]}
    with pytest.raises(UpdateRejected) as exc:
        raise_error(status, body, "/grid/rpc")
    assert exc.value.problems == {"layout": ["x"]}
    with pytest.raises(RuntimeError, match="HTTP 404"):
        raise_error(404, {"error": "no route"}, "/grid/x")
    from mxfp8_learner_grid.common.sync.protocol import check_bearer
    check_bearer("Bearer k1", {"k0", "k1"})
    check_bearer("", set())                          # no key configured: loopback rules apply elsewhere
    for wrong in ("Bearer k", "Bearer k1 ", "k1", "", None):
        with pytest.raises(BadRequest, match="API key") as exc:
            check_bearer(wrong, {"k0", "k1"})
        assert exc.value.status == 401


def test_bridge_outcomes_and_reply_files(monkeypatch, tmp_path):
    """The control-message bridge's framing (common/sync/bridge.py): outcomes as data, replies only where allowed."""
    from mxfp8_learner_grid.common.sync import bridge
    monkeypatch.setenv(bridge.REPLY_DIRS_ENV, str(tmp_path))
    msg = {"method": "grid_state", "args": [], "reply": "r.json"}
    named = [(bridge.CONTROL + __import__("json").dumps(msg), torch.empty(0))]
    assert bridge.is_control(named) and bridge.parse_control(named) == msg and not bridge.is_control([("w", None)])

    def refuse():
        raise UpdateRejected("no", {"completeness": ["a: missing"]})
    ok, bad = dict(bridge.outcome(lambda: {"v": 1}), rank=1), dict(bridge.outcome(refuse), rank=0)
    assert bridge.raise_failed([ok]) == [{"v": 1}]
    with pytest.raises(UpdateRejected, match="no") as exc:
        bridge.raise_failed([ok, bad])
    assert exc.value.problems == {"completeness": ["a: missing"]}
    d = tmp_path / (bridge.REPLY_PREFIX + "x")
    d.mkdir()
    assert bridge.write_reply(str(d / "r.json"), [ok]) and (d / "r.json").exists()
    assert not bridge.write_reply(str(tmp_path / "r.json"), [ok]) and not bridge.reply_path_ok("/etc/x.json")


def test_the_ranks_phases_reach_the_report_and_the_staging_is_released_once_per_update():
    """The client's report carries the slowest rank's phases as rank_* (loaders and refresh inside load),
    and a transport's done() runs once at the end of every update, applied or refused."""
    from mxfp8_learner_grid.common.sync.client import GridSyncClient
    ad = TinyAdapter()
    ad.version = 0
    t = _OneRankTransport(ad)
    ended = []
    t.done = lambda: ended.append(1)
    client = GridSyncClient(t, digest="full", bucket_bytes=1)
    rep = client.update_weights({"weight": torch.randn(64, 96)}, format="bf16", version=1)
    assert rep.ok, rep.summary()
    tm = rep.timings
    assert {"rank_begin_s", "rank_read_s", "rank_load_s", "rank_loaders_s", "rank_refresh_s", "rank_finish_s"} <= set(tm)
    assert 0 <= tm["rank_loaders_s"] + tm["rank_refresh_s"] <= tm["rank_load_s"] <= tm["transfer_s"]
    assert ended == [1]
    rep = client.update_weights({"weight": torch.randn(64, 96) * float("nan")}, format="bf16", version=2)
    assert not rep.applied and ended == [1, 1]


def test_a_registered_tensor_is_found_by_identity_and_a_reregistered_range_replaces_it():
    """``source_of`` finds a registered tensor itself without a range search; registering the same bytes again
    (the same tensor, or another view of them) replaces the older registration for both lookups."""
    rec = WriteRecorder({"p": torch.zeros(4, 32)}, backup=False)
    bucket = torch.randn(8, 32)
    a, b = bucket[:4], bucket[4:]
    rec.add_source(a, "a", "plain")
    rec.add_source(b, "b", "plain")
    assert rec.source_of(a).name == "a" and rec.source_of(b).name == "b" and rec.source_of(b[1:2]).name == "b"
    rec.add_source(a, "a2", "plain")                          # the same tensor again, under another name
    assert rec.source_of(a).name == "a2"
    same_bytes = bucket.narrow(0, 0, 4)                       # another view of a's bytes
    rec.add_source(same_bytes, "c", "plain")
    assert rec.source_of(a).name == "c" and rec.source_of(same_bytes).name == "c"
    assert rec.source_of(a[2:3]).name == "c"


def test_a_manifest_dict_is_dataclasses_asdict_of_it():
    import dataclasses
    m = Manifest.of({"a": torch.zeros(2, 64, dtype=torch.bfloat16), "b": torch.zeros(3)}, 7, "mxfp8", partial=True,
                    kv_scales={"0": [0.5, 2.0]})
    d = m.to_dict()
    assert d == dataclasses.asdict(m) and Manifest.from_json(m.to_json()) == m
    d["tensors"][0]["shape"].append(9)
    d["kv_scales"]["0"].append(1.0)
    assert m.tensors[0].shape == [2, 64] and m.kv_scales == {"0": [0.5, 2.0]}      # a copy, as asdict's


def test_slice_box_is_the_narrowed_view_and_refuses_a_box_outside():
    from mxfp8_learner_grid.common.sync.regions import slice_box
    base = torch.arange(4 * 6 * 8, dtype=torch.float32).reshape(4, 6, 8)
    for t in (base, torch.nn.Parameter(base.clone(), requires_grad=False), base[1:3], base[:, 2:5]):
        for box in (((0, t.shape[0]), (1, 2), (3, 4)), ((1, 1), (0, t.shape[1]), (2, 6)), ((0, 1), (1, 1), (0, 8)),
                    tuple((0, n) for n in t.shape)):
            v, w = slice_box(t, box), t
            for d, (s0, n) in enumerate(box):
                w = w.narrow(d, s0, n)
            assert (v.shape, v.stride(), v.storage_offset()) == (w.shape, w.stride(), w.storage_offset())
            assert torch.equal(v, w) and v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
        with pytest.raises((IndexError, RuntimeError)):
            slice_box(t, ((0, 1), (t.shape[1] - 1, 2), (0, 8)))
        with pytest.raises((IndexError, RuntimeError)):
            slice_box(t, ((0, 1), (0, 1), (-1, 2)))


def test_check_box_names_its_owner_and_refuses_a_wrong_rank_or_a_box_outside():
    from mxfp8_learner_grid.common.sync.regions import check_box

    class Owner:
        def __repr__(self):
            return "codes[2, 64, 64]"
    check_box(((0, 2), (63, 1)), (2, 64), "w")                       # inside: nothing
    for box in (((0, 2), (63, 2)), ((-1, 1), (0, 1)), ((0, 2),), ((0, 1), (0, 1), (0, 1))):
        with pytest.raises(IndexError, match=r"^w: box .* is outside its shape \[2, 64\]$"):
            check_box(box, (2, 64), "w")
    with pytest.raises(IndexError, match=r"^codes\[2, 64, 64\]: box"):
        check_box(((0, 3), (0, 64)), (2, 64), Owner())


def test_a_tensors_extent_is_the_bytes_it_touches():
    from mxfp8_learner_grid.common.sync.recorder import _extent
    b = torch.zeros(4, 6, 8, dtype=torch.bfloat16)
    assert _extent(b) == (0, 4 * 6 * 8 * 2) and _extent(b[1]) == (6 * 8 * 2, 2 * 6 * 8 * 2)
    assert _extent(b[1:3, 2:4]) == ((6 * 8 + 2 * 8) * 2, (2 * 6 * 8 + 3 * 8 + 8) * 2)
    assert _extent(b[:, :, 3]) == (3 * 2, (3 * 6 * 8 + 5 * 8 + 3 + 1) * 2)
