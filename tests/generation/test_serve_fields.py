"""Request fields of vLLM's protocol that change an answer act in `tandem serve` as in vLLM, or are refused with a
400 naming them: never accepted and ignored. Against a real `tandem serve` process."""

import pytest

from tests.conftest import ServeProcess

QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def serve():
    s = ServeProcess("--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1")
    yield s
    s.close()


def chat(serve, **fields) -> dict:
    status, answer = serve.post("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 6, "temperature": 0} | fields)
    assert status == 200, answer
    return answer


def complete(serve, **fields) -> dict:
    status, answer = serve.post("/v1/completions", {"prompt": [1, 5, 6, 7], "max_tokens": 6, "temperature": 0} | fields)
    assert status == 200, answer
    return answer


def refusal(serve, path: str, body: dict) -> str:
    status, answer = serve.post(path, body)
    assert status == 400, f"{body} should be a 400, got {status}: {answer}"
    return answer["error"]["message"]


# ---- message content ----------------------------------------------------------------------------------------------

def test_text_parts_are_joined_for_a_template_that_reads_strings(serve):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "2 + 2?"}]}]
    joined = [{"role": "user", "content": "What is\n2 + 2?"}]
    ids = [serve.post("/tokenize", {"messages": m})[1]["tokens"] for m in (parts, joined)]
    assert ids[0] == ids[1], "text parts must render as their newline-joined text (vLLM's join)"
    assert chat(serve, messages=parts)["choices"][0]["message"]["content"] == \
        chat(serve, messages=joined)["choices"][0]["message"]["content"]


def test_a_part_that_is_not_text_is_a_400_naming_it(serve):
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    assert "'image_url'" in refusal(serve, "/v1/chat/completions", {"messages": image})
