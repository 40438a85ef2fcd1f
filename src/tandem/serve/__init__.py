"""`tandem serve`: a vLLM-protocol generation server in one process. The app and its routes (`app.py`), requests
read and checked (`protocol.py`, `fields.py`, `preparation.py`), the batching engine (`engine.py`, `model_runner.py`,
`kv_cache.py`, `prefix_cache.py`), sampling (`sampling.py`, `emission.py`), replies (`responses.py`, `streaming.py`),
control routes (`control.py`, `lora.py`, `weight_receiver.py`, `transfer_config.py`) and vLLM's command-line flags
(`vllm_flags.py`)."""
