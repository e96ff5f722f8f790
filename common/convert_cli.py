"""Write a wire-format (pre-quantized) checkpoint, from a BF16 Hugging Face checkpoint or a TE export.

    mxfp8-grid-convert hf  SRC_DIR DST_DIR [--modules grid.yaml]
    mxfp8-grid-convert te  EXPORT DST_DIR --hf-config HF_DIR [--rename megatron-qwen3 | rules.yaml]

``hf``: ``convert.convert_hf`` (every on-grid Linear / expert weight quantized rowwise, TE-exact).
``te``: ``te_export.convert_te`` (the learner's own bytes, no quantization; ``--rename`` maps
TE/Megatron names to HF names: the built-in ``megatron-qwen3`` or a YAML list of
``[regex, replacement]`` rules).  Also ``python -m mxfp8_learner_grid.common.convert_cli``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .selection import ModuleSelection


def main(argv=None) -> int:
    from .convert import convert_hf          # convert re-exports this function
    from .te_export import convert_te
    ap = argparse.ArgumentParser(prog="mxfp8-grid-convert", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("hf", help="BF16 Hugging Face checkpoint -> wire format (quantized TE-exactly)")
    h.add_argument("src")
    h.add_argument("dst")
    h.add_argument("--modules", help="YAML/JSON module selection (include/exclude/layers)")
    t = sub.add_parser("te", help="TE / Megatron export -> wire format (the learner's bytes)")
    t.add_argument("export")
    t.add_argument("dst")
    t.add_argument("--hf-config", required=True, help="HF model dir with config.json (and tokenizer files)")
    t.add_argument("--rename", help="'megatron-qwen3' or a YAML list of [regex, replacement] rules")
    t.add_argument("--modules", help="module selection written to quantization_config")
    a = ap.parse_args(argv)
    sel = None
    if a.modules:
        import yaml
        sel = ModuleSelection.from_dict(yaml.safe_load(Path(a.modules).read_text()))
    if a.cmd == "hf":
        r = convert_hf(a.src, a.dst, sel)
    else:
        r = convert_te(a.export, a.dst, a.hf_config, a.rename, sel)
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
