"""vLLM's grid worker extension with the test faults (``tests/fault_injection.py``): engines under
test are started with ``worker_extension_cls="fault_worker.FaultyGridWorker"`` and this directory
on ``PYTHONPATH``; it adds ``grid_set_faults``.  Never shipped."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fault_injection import FaultyAdapterMixin  # noqa: E402
from mxfp8_learner_grid.vllm_plugin.sync_adapter import VLLMAdapter  # noqa: E402
from mxfp8_learner_grid.vllm_plugin.worker import GridWorkerExtension  # noqa: E402

WORKER = "fault_worker.FaultyGridWorker"


class FaultyVLLMAdapter(FaultyAdapterMixin, VLLMAdapter):
    pass


class FaultyGridWorker(GridWorkerExtension):
    adapter_cls = FaultyVLLMAdapter

    def grid_set_faults(self, faults_json: str) -> list:
        return self._grid().set_faults(json.loads(faults_json))
