"""CPU kernels that `tandem serve` and the trainer share, so that both compute the same numbers: exact attention
(`exact_attention.py`), large linear layers on oneDNN (`onednn_linear.py`), and OpenMP threads handed to them
(`openmp.py`)."""
