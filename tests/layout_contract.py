"""The layout contract both plugins' adapters must meet: the same fake layers -- each engine's own
fused-layer class, built without its constructor and given these attributes -- must yield the same
``LinearFacts`` and the same boxes.  The expected boxes are written out here by hand (what a
correct loader does with each Hugging Face shard), not computed by ``common.sync.expect``.

Boxes: ((row0, rows), (col0, cols)) in the learner tensor, then in the engine parameter."""

K = 256      # in features of this rank (row-parallel: of this rank's slice)

#: name -> (engine class, layer attributes, engine weight shape [n, k], {source: expected boxes | None})
CASES = {
    # TP 2, rank 1: 16 q heads and 4 kv heads of 128 per rank
    "qkv_tp2": ("QKVParallelLinear",
                dict(tp_rank=1, tp_size=2, num_heads=16, num_kv_heads=4, head_size=128, v_head_size=128,
                     num_kv_head_replicas=1),
                (2048 + 512 + 512, K),
                {"m.q_proj.weight": (((2048, 2048), (0, K)), ((0, 2048), (0, K))),
                 "m.k_proj.weight": (((512, 512), (0, K)), ((2048, 512), (0, K))),
                 "m.v_proj.weight": (((512, 512), (0, K)), ((2560, 512), (0, K))),
                 "m.o_proj.weight": None}),
    # TP 8 over 4 KV heads: every KV head on 2 ranks; rank 5 holds KV head 2
    "qkv_replicated_kv": ("QKVParallelLinear",
                          dict(tp_rank=5, tp_size=8, num_heads=4, num_kv_heads=1, head_size=128, v_head_size=128,
                               num_kv_head_replicas=2),
                          (512 + 128 + 128, K),
                          {"m.q_proj.weight": (((2560, 512), (0, K)), ((0, 512), (0, K))),
                           "m.k_proj.weight": (((256, 128), (0, K)), ((512, 128), (0, K))),
                           "m.v_proj.weight": (((256, 128), (0, K)), ((640, 128), (0, K)))}),
    # a V head size other than the Q/K one (the disagreement the review of issue #10 found)
    "qkv_v_head_64": ("QKVParallelLinear",
                      dict(tp_rank=0, tp_size=1, num_heads=8, num_kv_heads=2, head_size=128, v_head_size=64,
                           num_kv_head_replicas=1),
                      (1024 + 256 + 128, K),
                      {"m.k_proj.weight": (((0, 256), (0, K)), ((1024, 256), (0, K))),
                       "m.v_proj.weight": (((0, 128), (0, K)), ((1280, 128), (0, K)))}),
    # gate/up of 3072 rows each, TP 2, rank 1
    "merged_tp2": ("MergedColumnParallelLinear",
                   dict(tp_rank=1, tp_size=2, output_sizes=[3072, 3072]),
                   (3072, K),
                   {"m.gate_proj.weight": (((1536, 1536), (0, K)), ((0, 1536), (0, K))),
                    "m.up_proj.weight": (((1536, 1536), (0, K)), ((1536, 1536), (0, K))),
                    "m.down_proj.weight": None}),
    # down / o: K split, rank 1 of 2
    "row_tp2": ("RowParallelLinear", dict(tp_rank=1, tp_size=2), (4096, K),
                {"m.down_proj.weight": (((0, 4096), (K, K)), ((0, 4096), (0, K)))}),
}


def fake_layer(cls, attrs, shape):
    """An engine layer of ``cls`` without running its constructor (no TP groups needed)."""
    import torch
    layer = cls.__new__(cls)
    torch.nn.Module.__init__(layer)
    for k, v in attrs.items():
        object.__setattr__(layer, k, v)
    layer.weight = torch.empty(shape, dtype=torch.float8_e4m3fn)
    return layer


def check_adapter(adapter_cls, linear_module) -> int:
    """Every case through ``adapter_cls``'s facts and the shared arithmetic; returns the boxes checked.
    The scale boxes (``div`` = 32) follow from the data boxes with K / 32."""
    adapter = adapter_cls.__new__(adapter_cls)     # the layout methods read only the layer
    checked = 0
    for name, (cls_name, attrs, shape, expect) in CASES.items():
        layer = fake_layer(getattr(linear_module, cls_name), attrs, shape)
        for source, boxes in expect.items():
            got = adapter._dense_boxes(layer, source, 1)
            assert got == boxes, (name, source, got, boxes)
            if boxes is not None:
                (lr, (lc0, lk)), (er, (ec0, ek)) = boxes
                assert adapter._dense_boxes(layer, source, 32) == \
                    ((lr, (lc0 // 32, lk // 32)), (er, (ec0 // 32, ek // 32))), (name, source)
            checked += 1
    return checked
