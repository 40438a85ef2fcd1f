"""The policy model as every layer holds it: what an architecture needs (`architecture.py`), a model folder written
from one process or from shards (`model_folder.py`), and the ranks and FSDP2 sharding under torchrun
(`distributed.py`)."""
