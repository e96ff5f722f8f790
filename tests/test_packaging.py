"""Packaging: every code folder installs under the ``mxfp8_learner_grid`` namespace, nothing else.

An editable install finds sub-packages by path, so a folder missing from ``packages`` only
breaks a real (wheel) install -- e.g. on the GPU machine.  This test catches that here.
"""

import os
import tomllib

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _pyproject():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def test_every_code_folder_is_a_listed_package():
    st = _pyproject()
    dirs = st["package-dir"]
    listed = set(st["packages"])
    want = set()
    for pkg, folder in dirs.items():
        for here, subdirs, files in os.walk(os.path.join(ROOT, folder)):
            subdirs[:] = [d for d in subdirs if d != "__pycache__"]
            if any(f.endswith(".py") for f in files):
                rel = os.path.relpath(here, os.path.join(ROOT, folder))
                name = pkg if rel == "." else pkg + "." + rel.replace(os.sep, ".")
                want.add(name)
                assert "__init__.py" in files, f"{here} has modules but no __init__.py"
    assert want <= listed, f"not listed in pyproject packages: {sorted(want - listed)}"
    assert all(p.startswith("mxfp8_learner_grid.") for p in listed)
    assert "common" not in dirs
