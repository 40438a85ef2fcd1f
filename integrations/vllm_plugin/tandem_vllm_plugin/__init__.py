"""A vLLM plugin, installed into vLLM's own environment (never tandem's): registers the `gloo` weight-transfer
engine, so `vllm serve --weight-transfer-config '{"backend": "gloo"}'` takes tandem's weight stream on any device.

vLLM loads it in every process through its `vllm.general_plugins` entry point; the engine's module (which imports
torch.distributed and vLLM internals) loads only when a server asks for the backend.
"""


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(
            "gloo", "tandem_vllm_plugin.gloo_engine", "GlooWeightTransferEngine"
        )
    except ValueError:  # registered already: vLLM calls every plugin once per process, tests may call it again
        pass
