"""The update manifest: what a trainer is about to send, validated before the first byte is written.

A manifest lists every tensor of an update (Hugging Face names, shapes, dtypes) plus the
format (``bf16``: on-grid weights arrive in high precision and are quantized in the engine,
TE-exact; ``mxfp8``: they arrive as the learner's fp8 bytes + unpadded E8M0 scales) and the
weight version.  The engine checks it against the checkpoint signature of its own model
(read from the HF config on the meta device): unknown names, wrong shapes or dtypes,
duplicates, missing scales, and -- for a full update -- missing tensors are refused before
anything changes.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional

import torch

from .. import format as F
from ..grid_weight import data_problem, missing_scales_problem, scales_problem
from ..selection import ModuleSelection
from ..wire import SCALE_SUFFIX, WEIGHT_SUFFIX

FORMATS = ("bf16", "mxfp8")
MANIFEST_KEYS = ("version", "format", "tensors", "partial", "kv_scales")
MAX_VERSION = 2 ** 63          # versions are int64 on the wire (vLLM's header, SGLang's weight_version)
MAX_DIMS, MAX_DIM = 8, 2 ** 40


def _short(v) -> str:
    """repr of untrusted input, cut short (a hostile payload must not flood the error)."""
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."
_DTYPES = {str(d): d for d in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.uint8)}


@dataclass
class TensorSpec:
    name: str
    shape: list
    dtype: str


@dataclass
class Manifest:
    version: int
    format: str
    tensors: list = field(default_factory=list)      # [TensorSpec]
    partial: bool = False                            # True: update only the listed tensors
    kv_scales: Optional[dict] = None                 # {"<layer>": [k_scale, v_scale]}

    @classmethod
    def of(cls, named: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], version: int, format: str,
           partial: bool = False, kv_scales=None) -> "Manifest":
        items = named.items() if isinstance(named, Mapping) else named
        specs = [TensorSpec(n, list(t.shape), str(t.dtype)) for n, t in items]
        return cls(int(version), format, specs, partial, kv_scales)

    @classmethod
    def of_specs(cls, specs: Iterable[tuple[str, Iterable[int], torch.dtype]], version: int, format: str,
                 partial: bool = False, kv_scales=None) -> "Manifest":
        """From names, shapes and dtypes only (a stream's metadata pass; no tensor needed)."""
        return cls(int(version), format, [TensorSpec(n, [int(d) for d in shape], str(dtype)) for n, shape, dtype in specs],
                   partial, kv_scales)

    def to_dict(self) -> dict:
        """``dataclasses.asdict(self)``, built directly: asdict deep-copies field by field (30 us per tensor on
        this repo's CPU; a 30B-A3B update lists ~19,000 tensors)."""
        return {"version": self.version, "format": self.format,
                "tensors": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype} for t in self.tensors],
                "partial": self.partial, "kv_scales": copy.deepcopy(self.kv_scales)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, s: str) -> "Manifest":
        """Parse a manifest a trainer sent; a malformed one raises ``ValueError`` naming the field (or
        the tensor) -- untrusted input (HTTP, SGLang's bridge), checked before any rank reads it."""
        return cls.from_dict(json.loads(s))

    @classmethod
    def from_dict(cls, d) -> "Manifest":
        if not isinstance(d, dict):
            raise ValueError(f"a manifest is an object {{{', '.join(MANIFEST_KEYS)}}}; got {type(d).__name__}")
        unknown = set(d) - set(MANIFEST_KEYS)
        if unknown:
            raise ValueError(f"manifest: unknown keys {sorted(map(str, unknown))[:8]}")
        version = d.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < MAX_VERSION:
            raise ValueError(f"manifest: version must be an integer in [0, 2^63); got {_short(version)}")
        if d.get("format") not in FORMATS:
            raise ValueError(f"manifest: format must be one of {FORMATS}; got {_short(d.get('format'))}")
        partial, kv = d.get("partial", False), d.get("kv_scales")
        if not isinstance(partial, bool):
            raise ValueError(f"manifest: partial must be true or false; got {_short(partial)}")
        if kv is not None and not isinstance(kv, dict):
            raise ValueError(f"manifest: kv_scales must be an object {{layer: [k_scale, v_scale]}}; got {_short(kv)}")
        tensors = d.get("tensors", [])
        if not isinstance(tensors, list):
            raise ValueError(f"manifest: tensors must be a list; got {_short(tensors)}")
        specs = []
        for i, t in enumerate(tensors):
            if not isinstance(t, dict) or set(t) != {"name", "shape", "dtype"}:
                raise ValueError(f"manifest: tensor #{i} must be an object {{name, shape, dtype}}; got {_short(t)}")
            name, shape, dtype = t["name"], t["shape"], t["dtype"]
            if not isinstance(name, str) or not name:
                raise ValueError(f"manifest: tensor #{i}: name must be a non-empty string; got {_short(name)}")
            if not (isinstance(shape, list) and len(shape) <= MAX_DIMS and all(
                    isinstance(x, int) and not isinstance(x, bool) and 0 <= x < MAX_DIM for x in shape)):
                raise ValueError(f"manifest: {_short(name)}: shape must be a list of at most {MAX_DIMS} integers in "
                                 f"[0, 2^40); got {_short(shape)}")
            if not isinstance(dtype, str):
                raise ValueError(f"manifest: {_short(name)}: dtype must be a string; got {_short(dtype)}")
            specs.append(TensorSpec(name, shape, dtype))
        return cls(version, d["format"], specs, partial, kv)


def checkpoint_signature(hf_config, selection: ModuleSelection) -> dict[str, tuple[tuple[int, ...], bool]]:
    """{HF checkpoint name: (shape, on_grid)} of the model an engine serves (meta device)."""
    import transformers
    from torch import nn
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    grid_modules: set[str] = set()
    sig: dict[str, tuple[tuple[int, ...], bool]] = {}
    for mname, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and selection.matches(mname):
            grid_modules.add(mname)
    for name, p in model.state_dict().items():
        mname = name.rsplit(".", 1)[0]
        if name.endswith("gate_up_proj") and p.dim() == 3:          # transformers 5 fused experts
            e, two_i, h = p.shape
            on = selection.matches(mname)
            for x in range(e):
                sig[f"{mname}.{x}.gate_proj.weight"] = ((two_i // 2, h), on)
                sig[f"{mname}.{x}.up_proj.weight"] = ((two_i // 2, h), on)
        elif name.endswith("experts.down_proj") and p.dim() == 3:
            e, h, i = p.shape
            on = selection.matches(mname)
            for x in range(e):
                sig[f"{mname}.{x}.down_proj.weight"] = ((h, i), on)
        else:
            sig[name] = (tuple(p.shape), mname in grid_modules and name.endswith(WEIGHT_SUFFIX))
    return sig


def validate(manifest: Manifest, signature: Mapping[str, tuple], plain_dtypes: Mapping[str, torch.dtype],
             extra_names: Iterable[str] = ()) -> list[str]:
    """Problems with ``manifest`` against the engine's checkpoint signature ([] = fine)."""
    return flatten(validate_by_condition(manifest, signature, plain_dtypes, extra_names))


def flatten(by_condition: Mapping[str, list[str]]) -> list[str]:
    """Every problem of a ``validate_by_condition`` answer, in one list."""
    return [text for texts in by_condition.values() for text in texts]


def validate_by_condition(manifest: Manifest, signature: Mapping[str, tuple], plain_dtypes: Mapping[str, torch.dtype],
                          extra_names: Iterable[str] = ()) -> dict[str, list[str]]:
    """The same problems, each under the sync condition it would break: ``completeness`` (names:
    unknown, missing, sent twice) or ``layout`` (dtype, shape, the scales' layout, the format).

    ``plain_dtypes``: the dtype the engine holds each high-precision tensor in.
    ``extra_names``: further names the engine accepts (e.g. per-layer KV scales).
    """
    out: dict[str, list[str]] = {}

    def bad(condition: str, text: str) -> None:
        out.setdefault(condition, []).append(text)

    if manifest.format not in FORMATS:
        return {"layout": [f"format must be one of {FORMATS}; got {manifest.format!r}"]}
    names = [t.name for t in manifest.tensors]
    seen: set[str] = set()
    for n in names:
        if n in seen:
            bad("completeness", f"{n}: sent twice")
        seen.add(n)
    extra = set(extra_names)
    for t in manifest.tensors:
        if t.dtype not in _DTYPES:
            bad("layout", f"{t.name}: unsupported dtype {t.dtype}")
            continue
        dt = _DTYPES[t.dtype]
        if t.name.endswith(SCALE_SUFFIX):
            w = t.name[: -len(SCALE_SUFFIX)] + WEIGHT_SUFFIX
            if w not in signature or not signature[w][1]:
                bad("completeness", f"{t.name}: scales for a tensor that is not an on-grid weight")
                continue
            if manifest.format != "mxfp8":
                bad("layout", f"{t.name}: scales in a format='bf16' update (the engine quantizes bf16 weights itself)")
            shape, _ = signature[w]
            problem = scales_problem(t.name, t.shape, dt, shape)      # grid_weight's rules, on the spec
            if problem:
                bad("layout", problem)
            continue
        if t.name in extra:
            continue
        if t.name not in signature:
            bad("completeness", f"{t.name}: unknown tensor (not in this model's checkpoint)")
            continue
        shape, on_grid = signature[t.name]
        if list(t.shape) != list(shape):
            bad("layout", f"{t.name}: shape {list(t.shape)}; the model has {list(shape)}")
        if on_grid:
            if manifest.format == "mxfp8":
                if dt != F.FP8_DTYPE:
                    bad("layout", data_problem(t.name, t.shape, dt))
                sn = t.name[: -len(WEIGHT_SUFFIX)] + SCALE_SUFFIX
                if sn not in seen:
                    bad("completeness", missing_scales_problem(t.name))
            elif dt not in (torch.bfloat16, torch.float16, torch.float32):
                bad("layout", f"{t.name}: on-grid weight in a format='bf16' update must be high precision; got {t.dtype}")
        else:
            want = plain_dtypes.get(t.name)
            if want is not None and dt != want:
                bad("layout", f"{t.name}: dtype {t.dtype}; the engine holds it as {want}")
    if not manifest.partial:
        missing = [n for n in signature if n not in seen]
        if missing:
            bad("completeness", f"full update misses {len(missing)} tensors, e.g. {missing[:4]} "
                f"(send partial=True to update a subset)")
    return out
