"""`--weight-transfer-config` as vLLM reads it: a JSON object whose `backend` names the data plane (tandem serve's is
gloo). Kept apart from the receiver (which needs torch) so that `tandem serve` answers a mistake in it at once."""

import json

BACKENDS = ("gloo",)


def parse_config(text: str | None) -> dict | None:
    """`--weight-transfer-config` as vLLM reads it (JSON); tandem serve's data plane is gloo."""
    if text is None:
        return None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f'--weight-transfer-config {text!r} is not JSON ({exc}): write \'{{"backend": "gloo"}}\''
        ) from None
    if not isinstance(config, dict) or config.get("backend", "nccl") not in BACKENDS:
        raise ValueError(
            f"--weight-transfer-config {text}: tandem serve transfers weights over gloo "
            '(\'{"backend": "gloo"}\'); nccl is vllm serve\'s (on GPUs).'
        )
    return config
