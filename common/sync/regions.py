"""Boxes: where a write landed, in the coordinates of the tensor it belongs to.

Engines load a checkpoint tensor by narrowing (and selecting an expert of) both the
parameter and the checkpoint tensor, then ``copy_``.  A view made that way keeps its base's
strides, so its storage offset decomposes into one start index per base dimension.  A
``Box`` is that: ``((start, length), ...)`` per dimension of the base tensor (length 1 for a
selected dimension).  Boxes let both sides of a sync talk about the same bytes: the engine
reports (source box in the learner's tensor, destination box in its parameter); the learner
slices its own tensor with the source box.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

Box = tuple[tuple[int, int], ...]


def view_box(view: torch.Tensor, base_shape: Sequence[int], base_offset: int = 0) -> Optional[Box]:
    """The box a narrowed/selected view covers in a contiguous base of ``base_shape``.

    ``base_offset``: the base's own storage offset.  Returns None when the view is not a
    box of the base (transposed, strided, reshaped), which the recorder reports as such.
    """
    base_shape = tuple(int(s) for s in base_shape)
    strides, acc = [], 1
    for s in reversed(base_shape):
        strides.append(acc)
        acc *= s
    strides = tuple(reversed(strides))
    off = view.storage_offset() - base_offset
    if off < 0:
        return None
    starts = []
    for st in strides:
        starts.append(off // st)
        off -= starts[-1] * st
    if off:
        return None
    # match view dims to base dims through strides (selected dims are absent from the view)
    lengths = [1] * len(base_shape)
    vdims = [(st, n) for st, n in zip(view.stride(), view.shape) if n != 1]
    last = -1
    for st, n in vdims:
        if st not in strides:
            return None
        d = strides.index(st)
        if d <= last:                     # transposed / permuted: not the base's element order
            return None
        last = d
        lengths[d] = n
    box = tuple((int(a), int(b)) for a, b in zip(starts, lengths))
    if any(a + b > s for (a, b), s in zip(box, base_shape)):
        return None
    if box_volume(box) != view.numel():
        return None
    return box


def box_volume(box: Box) -> int:
    v = 1
    for _, n in box:
        v *= n
    return v


def boxes_overlap(a: Box, b: Box) -> bool:
    return all(sa < sb + nb and sb < sa + na for (sa, na), (sb, nb) in zip(a, b))


def slice_box(t: torch.Tensor, box: Box) -> torch.Tensor:
    """``t`` restricted to ``box`` (dims kept, so the result has the box's shape).  A tensor that knows its own
    layout (``PackedCodes``) makes the view itself, in one step."""
    shape = t.shape
    if type(t) in _PLAIN and len(box) == len(shape):
        # one strided view (a replay makes one or two per write), bounds checked in the same pass; a dim
        # covered whole moves nothing, and a box covering the tensor is the tensor itself
        stride = t.stride()
        off, cut = 0, False
        for (s, n), size, st in zip(box, shape, stride):
            if s < 0 or n < 0 or s + n > size:
                check_box(box, shape, "the tensor")        # raises, with the rule's message
            if s or n != size:
                cut = True
                off += s * st
        if not cut:
            return t
        return t.as_strided(tuple(n for _, n in box), stride, t.storage_offset() + off)
    own = getattr(t, "slice_box", None)
    if own is not None:
        return own(box)
    for d, (s, n) in enumerate(box):
        if s or n != shape[d]:
            t = t.narrow(d, s, n)
    return t


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def check_box(box: Box, shape: Sequence[int], owner: object) -> None:
    """Refuse (IndexError naming ``owner``: a string, or an object whose repr is taken only then) a box that is
    not one ``(start, length)`` per dim inside ``shape``."""
    ok = len(box) == len(shape)
    if ok:
        for (s, n), size in zip(box, shape):
            if s < 0 or n < 0 or s + n > size:
                ok = False
                break
    if not ok:
        what = owner if isinstance(owner, str) else repr(owner)
        raise IndexError(f"{what}: box {list(box)} is outside its shape {list(shape)}")


def coverage_problems(boxes: Iterable[Box], shape: Sequence[int]) -> list[str]:
    """Why ``boxes`` do not tile a tensor of ``shape`` exactly once ([] when they do)."""
    boxes = sorted(boxes)
    problems = []
    total = 1
    for s in shape:
        total *= int(s)
    # overlaps (duplicated writes): sweep on the first dimension
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if b[0][0] >= a[0][0] + a[0][1]:
                break
            if boxes_overlap(a, b):
                problems.append(f"written twice: {list(a)} and {list(b)}")
    covered = sum(box_volume(b) for b in boxes)
    if not problems and covered != total:
        problems.append(f"{total - covered} of {total} elements never written")
    return problems
