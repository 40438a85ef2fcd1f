"""The training side: the loop, batching, weight sync, checkpoints."""
