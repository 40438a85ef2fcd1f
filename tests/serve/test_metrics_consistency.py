"""`/metrics` read the moment a response arrives already counts it: never running, its tokens and success counted."""

from tandem.generation.client import parse_prometheus
from tests.conftest import ServeProcess


def totals(serve) -> dict[str, float]:
    status, text = serve.get("/metrics")
    assert status == 200
    values = {"vllm:request_success_total": 0.0}  # no sample before the first success
    for name, _, value in parse_prometheus(text):
        values[name] = values.get(name, 0.0) + value
    return values


def test_every_response_is_counted_before_it_reaches_the_client():
    serve = ServeProcess("--max-num-seqs", "4")
    try:
        before = totals(serve)
        for i in range(50):
            sampling = {"max_tokens": 1 + i % 5, "temperature": 1.0, "seed": i}
            if i % 2:
                status, answer = serve.post("/v1/completions", {"prompt": [1, 5, 6, 7], **sampling})
            else:
                status, answer = serve.post(
                    "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **sampling}
                )
            assert status == 200, answer
            after = totals(serve)
            assert after["vllm:num_requests_running"] == 0, f"response {i} is still counted running"
            assert after["vllm:request_success_total"] == before["vllm:request_success_total"] + 1, f"response {i}"
            generated = answer["usage"]["completion_tokens"]
            assert after["vllm:generation_tokens_total"] == before["vllm:generation_tokens_total"] + generated, (
                f"response {i}: {generated} tokens returned, the counter moved by "
                f"{after['vllm:generation_tokens_total'] - before['vllm:generation_tokens_total']}"
            )
            before = after
    finally:
        serve.close()
