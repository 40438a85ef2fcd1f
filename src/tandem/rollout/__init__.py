"""The rollout side: the worker process, the rollout loop, records, pacing, scoring."""
