"""Trainer sources (common/sync/sources.py): state dicts, FSDP2 DTensor shards on two gloo ranks,
and re-iterable streams -- the same HF-named tensors, one bucket at a time."""

import os
import socket
import sys
import weakref

import pytest
import torch

from mxfp8_learner_grid.common.sync.recorder import UpdateRejected
from mxfp8_learner_grid.common.sync.sources import DictSource, ShardedSource, StreamSource, as_source


def state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(50, 32, generator=g),
            "model.layers.0.mlp.experts.gate_up_proj": torch.randn(4, 2 * 16, 32, generator=g),
            "model.layers.0.mlp.experts.down_proj": torch.randn(4, 32, 16, generator=g),
            "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 32, generator=g),
            "model.norm.weight": torch.ones(32)}


def flat(src, bucket_bytes):
    out, sizes = {}, []
    for b in src.buckets(bucket_bytes):
        sizes.append(sum(t.numel() * t.element_size() for _, t in b))
        for n, t in b:
            assert n not in out
            out[n] = t.clone()
    return out, sizes


def test_dict_and_stream_sources_give_the_same_tensors():
    sd = state()
    ref = DictSource(sd)
    want = {n: t for n, t in ref.named.items()}
    assert len(want) == 3 + 4 * 3                                          # fused experts split per expert
    meta = ref.metadata()
    for src in (StreamSource(lambda: iter(sd.items())),
                StreamSource(lambda: iter(sd.items()), metadata=[(n, t.shape, t.dtype) for n, t in sd.items()]),
                as_source(lambda: iter(sd.items())), as_source(sd)):
        assert src.metadata() == meta
        got, _ = flat(src, 4096)
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
        names = ["model.layers.0.mlp.experts.2.up_proj.weight", "model.norm.weight"]
        assert all(torch.equal(dict(src.lookup(names))[n], want[n]) for n in names)


def test_a_stream_holds_about_one_bucket():
    """Tensors made on the fly and dropped by the consumer after each bucket: at most one bucket's
    worth is ever alive (a 30B state dict never has to fit twice in host memory)."""
    alive, peak = [0], [0]

    def make():
        for i in range(40):
            t = torch.full((256, 256), float(i))                         # 256 KiB each
            alive[0] += 1
            peak[0] = max(peak[0], alive[0])
            weakref.finalize(t, lambda: alive.__setitem__(0, alive[0] - 1))
            yield f"model.layers.{i}.mlp.down_proj.weight", t
    src = StreamSource(make)
    assert len(src.metadata()) == 40 and peak[0] <= 2                    # the metadata pass keeps nothing
    peak[0] = 0
    n = 0
    for b in src.buckets(1 << 20):                                       # 4 tensors per bucket
        n += len(b)
        del b
    assert n == 40 and peak[0] <= 5, peak[0]


def test_a_stream_that_changes_between_passes_is_refused():
    calls = [0]

    def make():
        calls[0] += 1
        items = list(state().items())
        return iter(items if calls[0] == 1 else items[:-1])
    src = StreamSource(make)
    src.metadata()
    with pytest.raises(UpdateRejected, match="the stream changed between passes"):
        flat(src, 1 << 20)


def test_wrong_fused_layouts_are_named_by_every_source():
    bad = {"model.layers.0.mlp.experts.down_proj": torch.randn(32, 16)}
    for make in (lambda: DictSource(bad), lambda: StreamSource(lambda: iter(bad.items())).metadata(),
                 lambda: ShardedSource(bad)):
        with pytest.raises(UpdateRejected, match=r"fused experts with 3-D shape \[E, H, I\] expected"):
            make()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port, out_dir, bucket_bytes):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    done = False
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        model = torch.nn.Module()
        for n, t in state(seed=3).items():                              # every rank builds the same weights
            model.register_parameter(n.replace(".", "__"), torch.nn.Parameter(t.clone()))
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        sd = {n.replace("__", "."): t for n, t in model.state_dict().items()}
        assert all(type(t).__name__ == "DTensor" for t in sd.values())
        src = ShardedSource(sd)
        if rank == 0:
            got, sizes = flat(src, bucket_bytes)
            looked = dict(src.lookup(["model.layers.0.mlp.experts.3.gate_proj.weight"]))
            src.close()
            torch.save({"got": got, "sizes": sizes, "looked": looked, "meta": src.metadata()},
                       os.path.join(out_dir, "rank0.pt"))
        else:
            n = src.follow()
            torch.save({"followed": n}, os.path.join(out_dir, "rank1.pt"))
        dist.barrier()
        done = True
    finally:
        dist.destroy_process_group()
    if done:
        # gloo's threads can abort the interpreter's teardown of a spawned rank ("terminate called without an
        # active exception", SIGABRT; seen once in CI, 2026-12-04): the results are saved, skip the teardown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def test_fsdp2_shards_on_two_gloo_ranks_are_gathered_one_bucket_at_a_time(tmp_path):
    pytest.importorskip("torch.distributed.fsdp")
    import torch.multiprocessing as mp
    mp.spawn(_rank, args=(2, _free_port(), str(tmp_path), 16 << 10), nprocs=2, join=True)
    r0 = torch.load(tmp_path / "rank0.pt")
    r1 = torch.load(tmp_path / "rank1.pt")
    want = DictSource(state(seed=3)).named
    assert r0["got"].keys() == want.keys() and all(torch.equal(r0["got"][n], want[n]) for n in want)
    assert r0["meta"] == DictSource(state(seed=3)).metadata()
    assert torch.equal(r0["looked"]["model.layers.0.mlp.experts.3.gate_proj.weight"],
                       want["model.layers.0.mlp.experts.3.gate_proj.weight"])
    # each bucket gathered on demand: one command per bucket plus the lookup, all followed by rank 1
    assert r1["followed"] == len(r0["sizes"]) + 1 and len(r0["sizes"]) >= 3
    assert max(r0["sizes"]) <= max(16 << 10, max(t.numel() * 4 for t in state().values()))
