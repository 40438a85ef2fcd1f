"""tandem: asynchronous reinforcement learning for language models, generation and training overlapped."""

__version__ = "0.1.0"
