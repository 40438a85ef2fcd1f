"""Generation: the vLLM-protocol client, and `tandem serve` (server, batching engine, sampling)."""
