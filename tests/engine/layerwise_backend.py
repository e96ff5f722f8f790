"""A vLLM weight-transfer backend for CPU tests, shaped like vLLM's own NCCL and CUDA-IPC engines.

vLLM 0.32's ``nccl`` and ``ipc`` backends need a GPU.  Both do the same around the transfer:
``start_weight_update`` runs ``initialize_layerwise_reload(model)`` (every layer rebuilt on the
meta device, loads buffered until a layer is complete, then ``process_weights_after_loading``
again and a copy into the live storage), each chunk goes through ``model.load_weights``, and
``finish_weight_update`` runs ``finalize_layerwise_reload``.  This backend does exactly that with
the tensors handed over in the request itself (in-process engine), so that the plugin's part of
the path -- its loaders and kernels under a layerwise reload -- is tested without a GPU.
Registered as ``layerwise_local``.  Test machinery: never shipped.
"""

from dataclasses import dataclass

from vllm.distributed.weight_transfer import WeightTransferEngineFactory
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

NAME = "layerwise_local"


@dataclass
class LocalInit(WeightTransferInitInfo):
    pass


@dataclass
class LocalUpdate(WeightTransferUpdateInfo):
    names: list
    tensors: list


class LayerwiseLocalEngine(WeightTransferEngine[LocalInit, LocalUpdate]):
    init_info_cls = LocalInit
    update_info_cls = LocalUpdate

    def init_transfer_engine(self, init_info):
        pass

    def start_weight_update(self):
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
        initialize_layerwise_reload(self.model)

    def receive_weights(self, info):
        self.model.load_weights(list(zip(info.names, info.tensors)))

    def finish_weight_update(self):
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self):
        pass


def register() -> None:
    try:
        WeightTransferEngineFactory.register_engine(NAME, LayerwiseLocalEngine)
    except ValueError:          # registered already
        pass
