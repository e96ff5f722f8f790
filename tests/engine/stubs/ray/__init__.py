"""A stand-in for Ray in the engine tests that refuses every use. Test machinery, never shipped.

vLLM 0.26's ``vllm/distributed/weight_transfer/ipc_engine.py`` does ``import ray`` at module top
(for its ``send_mode="ray"`` transport).  The H200 image has no Ray, so without this package
the ``ipc`` backend cannot even be created: the engine's worker imports that module when it
loads the model (``gpu_worker.Worker.load_model`` -> ``WeightTransferEngineFactory.create_engine``).
``tests/engine/native_update.py`` puts this package's folder on ``sys.path`` and on
``PYTHONPATH`` (the engine's processes) for its ``weight_transfer_ipc`` path only, and only when
no real Ray is installed.

The import succeeds and nothing else does:

* calling any of Ray's entry points (``ray.get``, ``ray.remote``, ``ray.init``, ...) raises
  :class:`RayStubUsed`, a ``RuntimeError``, so a code path that really needs Ray (for
  example ``IPCTrainerSendWeightsArgs(send_mode="ray")``) fails loudly instead of passing
  through the stub;
* ``ray.is_initialized()`` answers ``False`` -- the truth: there is no Ray.  vLLM asks it
  (``vllm/ray/lazy_utils.py``) while it builds its engine config;
* any other attribute is missing (``AttributeError``), and ``ray.util``, ``ray.actor``, ... are
  not modules, so ``from ray.util import ...`` raises ``ImportError``: the ``try: import ray
  ... except ImportError`` blocks of vLLM (``vllm/v1/executor/ray_utils.py``) conclude "no Ray",
  as they do without this package.
"""

MXFP8_GRID_TEST_STUB = True


class RayStubUsed(RuntimeError):
    """Something called Ray, but Ray is not installed: this is the test-only stand-in."""


def _refuse(name):
    def call(*args, **kwargs):
        raise RayStubUsed(
            f"ray.{name}() was called, but this `ray` is the test-only stub "
            f"({__file__}) that tests/engine/native_update.py puts on the path for vLLM's "
            "ipc weight-transfer backend; Ray is not installed, so nothing may use it "
            "(IPCTrainerSendWeightsArgs must get a callable send_mode, not 'ray')")
    call.__name__ = name
    return call


for _name in ("get", "put", "wait", "remote", "init", "shutdown", "kill", "cancel", "get_actor",
              "get_runtime_context", "method", "available_resources", "cluster_resources", "nodes",
              "get_gpu_ids"):
    globals()[_name] = _refuse(_name)
del _name


def is_initialized() -> bool:
    return False


def __getattr__(name):
    raise AttributeError(
        f"module 'ray' has no attribute {name!r}: this `ray` is the test-only stub ({__file__}); "
        "Ray is not installed")
