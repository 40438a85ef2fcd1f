"""A stand-in for vLLM in tests: only the trainer-side weight-transfer helpers tandem calls."""
