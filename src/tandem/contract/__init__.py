"""What the trainer and the rollout worker share: the records a rollout produces (`records.py`), the queues and
shared values between the two processes (`channels.py`), the chosen algorithm (`algorithms.py`) and the staleness
policy (`staleness.py`). Torch-free, so that the worker can import it without loading torch."""
