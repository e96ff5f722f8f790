"""Byte identity, both sides: the engine fingerprints the regions its loader wrote, the
client compares them with the learner's own bytes.

A region is ``[source, role, src_box, param, dest_box, fingerprint]`` (JSON-able): the
learner tensor ``source`` (its ``role``: "data", "scale" or "plain"), the box of it that was
written, and the fingerprint (``digest.fingerprint``) of where it landed, ``param[dest_box]``.
"""

from __future__ import annotations

import random

from .digest import fingerprint
from .regions import slice_box


def region_digests(writes: list, live: dict, digest: str = "sampled", fraction: float = 0.05,
                   seed: int = 0) -> list:
    """Engine side: the regions of ``writes`` (a recorder's) with the fingerprints of the bytes now in
    ``live`` (parameters by name) -- every write (``digest="full"``), the on-grid ones, or a seeded
    ``fraction`` of those (``"sampled"``); none for ``"off"``."""
    if digest == "off":
        return []
    writes = [w for w in writes if w.role in ("data", "scale") or digest == "full"]
    if digest == "sampled":
        k = max(1, int(round(len(writes) * fraction))) if writes else 0
        writes = random.Random(seed).sample(writes, k) if k < len(writes) else writes
    return [[w.source, w.role, [list(b) for b in (w.src_box or [])], w.param, [list(b) for b in w.dest_box],
             fingerprint(slice_box(live[w.param].detach(), w.dest_box))]
            for w in writes if w.dest_box is not None and w.param in live]


def fingerprint_regions(truth, regions: list) -> list[str]:
    """Client side of byte identity: compare the engine's region fingerprints with the learner's own bytes.

    ``truth(name, role)`` returns the learner's tensor for a region's source: its fp8 data
    (role "data") or uint8 scales (role "scale") for an on-grid weight, the tensor itself
    ("plain").
    """
    problems = []
    for source, role, src_box, param, dest_box, fp in regions:
        t = truth(source, role)
        if t is None:
            problems.append(f"{source}: the learner has no such tensor")
            continue
        box = tuple(tuple(b) for b in src_box) if src_box else None
        mine = fingerprint(slice_box(t, box) if box else t)
        if mine != fp:
            problems.append(f"{source} ({role}) -> {param}{dest_box}: engine bytes differ from the learner's")
    return problems
