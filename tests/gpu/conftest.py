import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Skip the tests under tests/gpu (only those) when there is no CUDA GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
