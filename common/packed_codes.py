"""A MoE layer's E4M3 codes held once, in Marlin's packed layout: a tensor that knows its layout.

On Marlin MoE a layer's experts need their codes in Marlin's tiled layout (``grid_marlin_w13`` /
``grid_marlin_w2``), while every loader, update and sync check speaks the checkpoint's layout
([E, N, K], the learner's bytes).  Keeping both costs a second byte per weight (docs/memory.md:
Qwen3-30B-A3B's grid weights took 60.8 GiB against BF16's 56.9, and the KV cache paid for it).

:class:`PackedCodes` is the checkpoint-layout parameter with no storage of its own, as TE's
``Float8Tensor`` is a tensor whose bytes live elsewhere: a ``torch.Tensor`` wrapper subclass of
shape [E, N, K] and dtype float8_e4m3fn over the packed int32 buffer [E, K/16, 4 N] -- the one
copy, the one the kernel reads.  The packing is a byte permutation
(``grid_kernels.marlin.marlin_weights_batched``, its inverse ``marlin_unpack_batched``), so:

* **views** -- ``detach``, ``alias``, ``select``, ``unbind`` and ``slice`` (what ``param.data[e].narrow(d, a, n)``
  is made of, the engines' expert loaders) -- are PackedCodes again, with the strides and storage
  offset a contiguous [E, N, K] tensor's view would have, so the sync's boxes
  (``sync.regions.view_box``) read them as they read any parameter's;
* **a write** (``copy_``, ``_foreach_copy_``, ``zero_``, ``fill_``) into a view repacks the box in place: rows that are
  whole 64-row groups over all of K (every gate / up / down write of a layer Marlin MoE takes) are
  packed straight into their byte groups; any other box is a read-modify-write of its experts;
* **a read** (any other op that neither writes a PackedCodes nor returns a view of one: ``clone``,
  ``to``, ``equal``, arithmetic) unpacks just the experts its view covers and runs on those bytes;
* anything else -- another view op (``view``, ``reshape``, ``t``, ``expand`` ...), an in-place op
  other than a copy -- raises, naming the op: such a view or write would silently miss the packed
  bytes.  Code that wants the checkpoint-layout bytes as a plain tensor calls :func:`plain`.

``data_ptr()`` and ``untyped_storage()`` are the packed buffer's: the sync attributes writes by
storage and watches a parameter's storage for reallocation, and both then see the one copy.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from . import format as F
from .sync.regions import check_box

aten = torch.ops.aten
_VIEWS = {aten.detach.default, aten.alias.default}
#: Marlin's byte groups are 64 rows (4 tiles of 16) wide over 16 values of K
_GROUP_ROWS, _GROUP_BYTES, _TILE = 64, 1024, 16


def _full_strides(shape) -> tuple:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


class PackedCodes(torch.Tensor):
    """[E, N, K] float8_e4m3fn codes whose one copy is Marlin's packed int32 ``packed`` [E, K/16, 4 N]."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, packed: torch.Tensor, n: int, shape=None, stride=None, offset: int = 0):
        if packed.dtype != torch.int32 or packed.dim() != 3 or not packed.is_contiguous() or packed.shape[2] != 4 * n:
            raise ValueError(f"PackedCodes: want a contiguous int32 [E, K/16, 4 N] buffer with N={n}; "
                             f"got {packed.dtype} {list(packed.shape)}")
        full = (int(packed.shape[0]), int(n), int(packed.shape[1]) * _TILE)
        if shape is None:
            shape, stride = full, _full_strides(full)
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), strides=tuple(stride), storage_offset=offset,
                                                dtype=F.FP8_DTYPE, device=packed.device, requires_grad=False)
        t._packed = packed
        t._full = full
        return t

    # -- the one copy ------------------------------------------------------------------------
    def data_ptr(self) -> int:                     # noqa: D102 -- the packed buffer's (storage stability)
        return self._packed.data_ptr()

    def untyped_storage(self):                     # noqa: D102 -- the packed buffer's (write attribution)
        return self._packed.untyped_storage()

    def __reduce_ex__(self, protocol):
        # pickled (torch.save of a state_dict, an RPC returning it): the checkpoint-layout codes, a plain tensor
        return self.materialize().__reduce_ex__(protocol)

    @property
    def packed(self) -> torch.Tensor:
        return self._packed

    def __repr__(self) -> str:
        return (f"PackedCodes(shape={list(self.shape)}, of [E, N, K]={list(self._full)}, held as Marlin int32 "
                f"{list(self._packed.shape)} on {self._packed.device})")

    def is_whole(self) -> bool:
        """This view is the whole codes [E, N, K], in their own strides (a box of it is known without a search)."""
        return (tuple(self.shape) == self._full and self.storage_offset() == 0
                and tuple(self.stride()) == _full_strides(self._full))

    def box(self):
        """((e0, ne), (n0, nn), (k0, nk)): what this view covers of [E, N, K]."""
        from .sync.regions import view_box
        box = getattr(self, "_box", None)
        if box is not None:
            return box
        box = view_box(self, self._full, 0)
        if box is None:
            raise ValueError(f"{self!r}: not a box of the codes (a view the packed layout cannot take)")
        return box

    def materialize(self) -> torch.Tensor:
        """This view's codes as a plain tensor (the experts it covers unpacked, then cut to the box)."""
        from .grid_kernels.marlin import marlin_unpack_batched
        if self.numel() == 0:
            return torch.empty(self.shape, dtype=self.dtype, device=self.device)
        (e0, ne), (n0, nn), (k0, nk) = self.box()
        codes = marlin_unpack_batched(self._packed[e0:e0 + ne], self._full[1])
        return codes[:, n0:n0 + nn, k0:k0 + nk].reshape(self.shape)

    def write(self, src) -> None:
        """``self.copy_(src)``: the box repacked in place (broadcasting and casts as ``copy_`` does them)."""
        from .grid_kernels.marlin import marlin_unpack_batched, marlin_weights_batched
        if self.numel() == 0:
            return
        (e0, ne), (n0, nn), (k0, nk) = self.box()
        _, n, k = self._full
        dest = self._packed[e0:e0 + ne]
        if isinstance(src, PackedCodes):
            if src._full == self._full and (n0, nn, k0, nk) == (0, n, 0, k) and src.box() == self.box():
                dest.copy_(src._packed[e0:e0 + ne])  # whole experts of the same layout (a rollback): their bytes
                return
            src = src.materialize()
        if _packs_straight(self, src, ((e0, ne), (n0, nn), (k0, nk))):
            rows = src.to(self.device).reshape(ne, nn, k).contiguous()
            if (n0, nn) == (0, n):                   # whole experts: packed straight into the buffer
                marlin_weights_batched(rows, out=dest)
                return
            _row_groups(dest, n0, nn).copy_(_row_groups(marlin_weights_batched(rows), 0, nn))
            return
        codes = marlin_unpack_batched(dest, n)       # any other box: read, modify, write back its experts
        codes[:, n0:n0 + nn, k0:k0 + nk].view(self.shape).copy_(src)    # a view: only size-1 dims dropped
        marlin_weights_batched(codes, out=dest)

    def slice_box(self, box) -> "PackedCodes":
        """``regions.slice_box(self, box)`` (the box's shape, dims kept) as one view rather than a narrow per
        dim, each a pass through the dispatch below (a write plan's replay makes one per write)."""
        check_box(box, self.shape, self)
        stride = self.stride()
        view = self._view(tuple(n for _, n in box), stride,
                          self.storage_offset() + sum(s * st for (s, _), st in zip(box, stride)))
        if self.is_whole():
            view._box = tuple((int(s), int(n)) for s, n in box)     # a box of the whole codes: known already
        return view

    # -- dispatch ----------------------------------------------------------------------------
    def _view(self, shape, stride, offset) -> "PackedCodes":
        return PackedCodes(self._packed, self._full[1], shape, stride, offset)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _VIEWS:
            s = args[0]
            return s._view(s.shape, s.stride(), s.storage_offset())
        if func is aten.select.int:
            s, dim, index = args
            dim, size = dim % s.dim(), s.shape[dim % s.dim()]
            if not -size <= index < size:
                raise IndexError(f"index {index} is out of bounds for dimension {dim} with size {size}")
            index %= size
            shape, stride = list(s.shape), list(s.stride())
            offset = s.storage_offset() + index * stride[dim]
            del shape[dim], stride[dim]
            return s._view(shape, stride, offset)
        if func is aten.unbind.int:                   # iterating over experts: one select each
            s, dim = args[0], (args[1] if len(args) > 1 else kwargs.get("dim", 0))
            return tuple(aten.select.int(s, dim, i) for i in range(s.shape[dim]))
        if func is aten.slice.Tensor:
            s, dim = args[0], (args[1] if len(args) > 1 else kwargs.get("dim", 0))
            start = args[2] if len(args) > 2 else kwargs.get("start")
            end = args[3] if len(args) > 3 else kwargs.get("end")
            step = args[4] if len(args) > 4 else kwargs.get("step", 1)
            if step != 1:
                raise NotImplementedError(f"{s!r}: a slice with step {step} is not a box of the packed codes")
            dim = dim % s.dim()
            size = s.shape[dim]
            start, end = (0 if start is None else start), (size if end is None else end)
            start, end = (start + size if start < 0 else start), (end + size if end < 0 else end)
            start = min(max(start, 0), size)
            end = min(max(end, start), size)
            shape, stride = list(s.shape), list(s.stride())
            shape[dim] = end - start
            return s._view(shape, stride, s.storage_offset() + start * stride[dim])
        if func is aten.copy_.default and isinstance(args[0], PackedCodes):
            args[0].write(args[1])
            return args[0]
        if func in (aten.zero_.default, aten.fill_.Scalar) and isinstance(args[0], PackedCodes):
            s = args[0]                      # a loader zeroing padding, say: a write of that value
            value = 0 if func is aten.zero_.default else args[1]
            s.write(torch.full(s.shape, value, dtype=torch.float32, device=s.device).to(s.dtype))
            return s
        if func is aten._foreach_copy_.default:
            write_all(args[0], args[1])
            return None
        out = func.decompose(*args, **kwargs)        # a composite op (to, narrow, reshape ...) as its parts, which
        if out is not NotImplemented:                # come back here (an engine's mode may hand them over whole)
            return out
        schema = func._schema
        returned = set()                             # alias sets the op's outputs share with its inputs
        for r in schema.returns:
            if r.alias_info is not None:
                returned |= set(r.alias_info.before_set)
        for i, a in enumerate(schema.arguments):
            if a.alias_info is None:
                continue
            v = args[i] if i < len(args) else kwargs.get(a.name)
            if not any(isinstance(x, PackedCodes) for x in (v if isinstance(v, (list, tuple)) else [v])):
                continue
            if a.alias_info.is_write:
                raise NotImplementedError(
                    f"{func}: writes into packed MoE codes only through copy_ into a box (a loader's "
                    f"narrow(...).copy_); this op would miss the packed bytes")
            if returned & set(a.alias_info.before_set):
                raise NotImplementedError(
                    f"{func}: a view of packed MoE codes other than select / slice would not see the packed "
                    f"bytes; read them with mxfp8_learner_grid.common.packed_codes.plain(t) first")

        def unwrap(x):
            return x.materialize() if isinstance(x, PackedCodes) else x
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


def _packs_straight(dest: PackedCodes, src, box) -> bool:
    """Can ``dest <- src`` (``box``: dest's) be packed straight into its bytes -- whole 64-row groups over all of
    K, from fp8 codes of dest's shape -- rather than by a read-modify-write of its experts?"""
    _, (n0, nn), (k0, nk) = box
    return ((k0, nk) == (0, dest._full[2]) and n0 % _GROUP_ROWS == 0 and nn % _GROUP_ROWS == 0
            and isinstance(src, torch.Tensor) and src.dtype == dest.dtype
            and _unit_dims_dropped(src.shape) == _unit_dims_dropped(dest.shape))


def _unit_dims_dropped(shape) -> tuple:
    """``shape`` without its size-1 dims: a copy between two such shapes moves the same elements in the same
    order (a write plan's box keeps the expert dim, [1, n, K], where its source is [n, K])."""
    return tuple(int(d) for d in shape if d != 1)


def _row_groups(packed: torch.Tensor, n0: int, nn: int) -> torch.Tensor:
    """The bytes of rows [n0, n0 + nn) (multiples of 64) of Marlin's int32 [E, K/16, 4 N] layout, as a uint8 view
    [E, K/16, nn / 64, 1024]: the packing of 64 rows is one 1024-byte group in each 16-wide K tile."""
    e, kt, n4 = packed.shape
    groups = packed.view(torch.uint8).view(e, kt, n4 // 4 // _GROUP_ROWS, _GROUP_BYTES)
    return groups[:, :, n0 // _GROUP_ROWS:(n0 + nn) // _GROUP_ROWS]


def write_all(dests, srcs) -> None:
    """``torch._foreach_copy_(dests, srcs)`` where some destinations are PackedCodes (a write plan's replay of a
    bucket: a MoE layer's gate / up / down shards, expert by expert).  Plain pairs are copied in one
    ``_foreach_copy_``; packed writes of the same rows of one buffer's experts (e.g. every expert's up_proj)
    are packed together and scattered in one ``index_copy_`` per group of at most ``REPACK_CHUNK_BYTES``,
    instead of a pack and a copy per expert; any other packed write on its own.  Writes whose boxes overlap
    keep their order: then every write runs on its own, in order."""
    from .grid_kernels.marlin import REPACK_CHUNK_BYTES, marlin_weights_batched
    from .sync.regions import boxes_overlap
    plain_pairs, packed = [], []
    for dest, src in zip(dests, srcs):
        src = src.materialize() if isinstance(src, PackedCodes) else src
        if isinstance(dest, PackedCodes):
            if dest.numel():
                packed.append((dest, src, dest.box()))
        else:
            plain_pairs.append((dest, src))
    if plain_pairs:
        torch._foreach_copy_([d for d, _ in plain_pairs], [s for _, s in plain_pairs])
    by_expert: dict = {}
    for dest, _, box in packed:
        by_expert.setdefault((id(dest._packed), box[0][0]), []).append(box)
    if any(boxes_overlap(a, b) for boxes in by_expert.values() for i, a in enumerate(boxes) for b in boxes[i + 1:]) \
            or any(box[0][1] != 1 for _, _, box in packed):
        for dest, src, _ in packed:                   # overlapping (or multi-expert) boxes: in order, one by one
            dest.write(src)
        return
    groups: dict = {}
    for dest, src, box in packed:                     # one expert each (multi-expert boxes went one by one above)
        if _packs_straight(dest, src, box):
            groups.setdefault((id(dest._packed), box[1]), []).append((dest, src, box[0][0]))
        else:
            dest.write(src)
    for (_, (n0, nn)), items in groups.items():
        if len(items) == 1:
            items[0][0].write(items[0][1])
            continue
        dest0 = items[0][0]
        k = dest0._full[2]
        rows_view = _row_groups(dest0._packed, n0, nn)
        step = max(1, REPACK_CHUNK_BYTES // (nn * k))
        for lo in range(0, len(items), step):
            chunk = items[lo:lo + step]
            rows = torch.stack([src.to(dest0.device).reshape(nn, k) for _, src, _ in chunk])
            experts = torch.tensor([ex for _, _, ex in chunk], dtype=torch.int64, device=dest0.device)
            rows_view.index_copy_(0, experts, _row_groups(marlin_weights_batched(rows), 0, nn))


def copy_held(t: torch.Tensor, device) -> torch.Tensor:
    """A copy of ``t``'s bytes on ``device`` (the sync's backup of a parameter before an update writes it): a
    whole PackedCodes copied on its own device stays packed -- one copy of the int32 buffer, no unpack -- and
    ``copy_`` of it back (a rollback) is a copy of those bytes again; anything else as a plain copy."""
    device = torch.device(device)
    if isinstance(t, PackedCodes) and device == t.device and t.is_whole():
        return PackedCodes(t.packed.clone(), t._full[1])
    return plain(t).detach().to(device, copy=True)


def plain(t):
    """``t`` as a plain tensor: a :class:`PackedCodes` view unpacked, anything else as it is."""
    return t.materialize() if isinstance(t, PackedCodes) else t


def hold_packed(layer, attr: str, packed: torch.Tensor) -> torch.nn.Parameter:
    """Make ``packed`` (Marlin's int32 layout of ``layer.<attr>``'s [E, N, K] codes, already written) the one
    copy: ``layer.<attr>`` becomes a :class:`PackedCodes` parameter over it, keeping the old parameter's
    attributes (the engine's ``weight_loader`` and the grid's wrappers); the old storage is released."""
    old = getattr(layer, attr)
    if isinstance(old, PackedCodes):
        if old.packed is not packed:
            raise ValueError(f"{attr}: already held in another packed buffer")
        return old
    new = torch.nn.Parameter(PackedCodes(packed, int(old.shape[-2])), requires_grad=False)
    if tuple(new.shape) != tuple(old.shape):
        raise ValueError(f"{attr}: packed buffer {list(packed.shape)} is not the layout of {list(old.shape)}")
    for key, value in vars(old).items():
        setattr(new, key, value)
    setattr(layer, attr, new)
    return new
