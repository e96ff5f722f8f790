"""Is SGLang installed?  Asked of the distribution metadata, not by import (cheap; and no
folder on tests/' sys.path can pass for the package -- this one is named sglang_engine
for that reason)."""

import importlib.metadata


def sglang_installed() -> bool:
    try:
        importlib.metadata.version("sglang")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False
