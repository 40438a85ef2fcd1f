"""The prefix-preserving check of chat templates and the training templates of known families (tandem.chat.prompts).
A multi-turn rollout is one training sequence only when each turn's prompt extends the previous one token for
token; Qwen3's template rewrites earlier turns, and its training template does not."""

import copy
from pathlib import Path

import pytest

from tandem.chat.prompts import PROBE_TOOL, check_prefix_preserving, probe_conversation, training_chat_template

QWEN3_LIKE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1) %}
{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query_index = loop.index0 %}{%- endif %}{%- endfor %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{%- set content = message.content %}
{%- set reasoning_content = '' %}
{%- if message.reasoning_content is string %}
{%- set reasoning_content = message.reasoning_content %}
{%- elif '</think>' in content %}
{%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\n') %}
{%- endif %}
{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
{{- '<|im_start|>assistant\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
{%- else %}
{{- '<|im_start|>assistant\n' + content }}
{%- endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- set call = tool_call.function if tool_call.function is defined else tool_call %}
{%- if content or not loop.first %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' }}
{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
"""
"""Qwen3's hybrid-thinking chat template as it renders, written for these tests (no download): ChatML turns,
`<tool_call>` JSON blocks, tool results grouped in one user turn, `enable_thinking=False` closing an empty
`<think>` block in the generation prompt, and the assistant turns rewritten once they are no longer last: the
reasoning of turns before the last question dropped, the empty `<think>` block of a turn without reasoning too."""

ONLY_THE_LAST_REPLY = (
    "{%- for m in messages %}{%- if m.role != 'assistant' or loop.last %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""A template of no known family that is not prefix-preserving: earlier replies vanish from the history."""


@pytest.fixture
def qwen3(tokenizer):
    """The tiny tokenizer with the Qwen3-like template (a copy: the session's tokenizer stays as it is)."""
    qwen3 = copy.deepcopy(tokenizer)
    qwen3.chat_template = QWEN3_LIKE
    return qwen3


def test_the_tiny_template_is_prefix_preserving(tokenizer):
    assert check_prefix_preserving(tokenizer, [PROBE_TOOL], None) is None
    assert check_prefix_preserving(tokenizer, [], None) is None, "without tools too"
    assert training_chat_template(tokenizer) is None, "nothing to patch"


def test_qwen3_is_not_prefix_preserving_in_either_thinking_mode(qwen3):
    thinking = check_prefix_preserving(qwen3, [PROBE_TOOL], None)
    assert thinking is not None and thinking.startswith("the prompt of reply 2 "), thinking
    assert "I should use the calculator" in thinking, f"the reasoning dropped from the tool call: {thinking}"
    not_thinking = check_prefix_preserving(qwen3, [PROBE_TOOL], {"enable_thinking": False})
    assert not_thinking is not None and not_thinking.startswith("the prompt of reply 1 "), not_thinking
    assert "\n" not in thinking + not_thinking, "the reasons are one line each"


def test_qwen3s_training_template_is_prefix_preserving(qwen3):
    family, template = training_chat_template(qwen3)
    assert family == "qwen3"
    for kwargs in (None, {"enable_thinking": True}, {"enable_thinking": False}):
        assert check_prefix_preserving(qwen3, [PROBE_TOOL], kwargs, chat_template=template) is None, kwargs
    qwen3.chat_template = template
    assert training_chat_template(qwen3) is None, "the training template needs no patch"


def conversations() -> list[list[dict]]:
    """Conversations ending in a reply: each cut of the probe (with and without reasoning, and with the
    reasoning written in the content as `<think>` text), a system prompt, a reply with text before its call, and
    reasoning and content with newlines around them (which Qwen3 trims)."""
    with_think_text = [dict(m) for m in probe_conversation(True)]
    for m in with_think_text:
        if "reasoning_content" in m:
            m["content"] = f"<think>\n{m.pop('reasoning_content')}\n</think>\n\n{m['content']}"
    probes = [probe_conversation(False), probe_conversation(True), with_think_text]
    cuts = [probe[: k + 1] for probe in probes for k, m in enumerate(probe) if m["role"] == "assistant"]
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1 + 2"}}}
    question = {"role": "user", "content": "1 + 2?"}
    return cuts + [
        [{"role": "system", "content": "Be brief."}, question, {"role": "assistant", "content": "3."}],
        [question, {"role": "assistant", "content": "Let me see.", "tool_calls": [call, call]}],
        [question, {"role": "assistant", "reasoning_content": "\nEasy.\n\n", "content": "\n\n3."}],
    ]


def last_reply(text: str) -> str:
    """The rendered text of a conversation's last reply."""
    return text.rsplit("<|im_start|>assistant\n", 1)[1]


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
@pytest.mark.parametrize("tools", [[PROBE_TOOL], None])
def test_qwen3s_training_template_renders_the_last_reply_and_the_prompt_as_qwen3_does(qwen3, kwargs, tools):
    """The last reply (what the model wrote) and the prompt of a first question render as in Qwen3's template."""
    _, template = training_chat_template(qwen3)

    def render(messages, chat_template=None, **options):
        return qwen3.apply_chat_template(
            messages, tools=tools, tokenize=False, chat_template=chat_template, **options, **kwargs
        )

    for messages in conversations():
        assert last_reply(render(messages, template)) == last_reply(render(messages)), messages
        first_question = messages[: next(k for k, m in enumerate(messages) if m["role"] == "user") + 1]
        prompt = render(first_question, add_generation_prompt=True)
        assert render(first_question, template, add_generation_prompt=True) == prompt, first_question


def test_no_training_template_for_a_family_it_does_not_know(tokenizer):
    unknown = copy.deepcopy(tokenizer)
    unknown.chat_template = ONLY_THE_LAST_REPLY
    reason = check_prefix_preserving(unknown, [], None)
    assert reason is not None and reason.startswith("the prompt of reply 1 "), reason
    assert training_chat_template(unknown) is None


def test_a_template_that_refuses_the_probe_says_so(tokenizer):
    refusing = copy.deepcopy(tokenizer)
    refusing.chat_template = "{{ raise_exception('tool messages are not supported') }}"
    assert check_prefix_preserving(refusing, [PROBE_TOOL], None) == (
        "the chat template cannot render a tool-calling probe conversation: tool messages are not supported"
    )


DEEPSEEK_V3 = (Path(__file__).parent / "fixtures" / "deepseek_v3_chat_template.jinja").read_text()
"""DeepSeek-V3's chat template in the variant whose generation prompt opens a `<think>` block (tests/fixtures)."""
DEEPSEEK_V3_PLAIN = DEEPSEEK_V3.replace("'<｜Assistant｜><think>\\n'", "'<｜Assistant｜>'").replace(
    "{{'<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}",
    "{{'\\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}",
)
"""The variant without `<think>` in the generation prompt, later tool outputs after a newline."""


@pytest.mark.parametrize("source", [DEEPSEEK_V3, DEEPSEEK_V3_PLAIN], ids=["think", "plain"])
def test_deepseek_v3s_training_template_is_prefix_preserving_and_renders_a_question_as_deepseek_does(tokenizer, source):
    deepseek_v3 = copy.deepcopy(tokenizer)
    deepseek_v3.chat_template = source
    assert check_prefix_preserving(deepseek_v3, [PROBE_TOOL], None) is not None, "DeepSeek-V3's own is not"
    family, template = training_chat_template(deepseek_v3)
    assert family == "deepseek_v3"
    assert check_prefix_preserving(deepseek_v3, [PROBE_TOOL], None, chat_template=template) is None
    question = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    for add_generation_prompt in (True, False):
        assert deepseek_v3.apply_chat_template(
            question, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt
        ) == deepseek_v3.apply_chat_template(question, tokenize=False, add_generation_prompt=add_generation_prompt)
    conversation = probe_conversation(with_reasoning=False)[:4]  # the original renders string arguments only
    conversation[1]["tool_calls"][0]["function"]["arguments"] = '{"expression": "2 + 3"}'
    conversation.insert(3, {"role": "tool", "content": "and again 5"})  # two tool outputs in a row
    ours = deepseek_v3.apply_chat_template(conversation, chat_template=template, tokenize=False)
    theirs = deepseek_v3.apply_chat_template(conversation, tokenize=False)
    if source == DEEPSEEK_V3:  # the prompt's <think> kept in the reply, which DeepSeek-V3's own drops
        theirs = theirs.replace(
            "<｜Assistant｜><｜tool▁calls▁begin｜>", "<｜Assistant｜><think>\n<｜tool▁calls▁begin｜>"
        )
    assert ours == theirs, "a reply that calls a tool, two outputs, an answer: DeepSeek-V3's format"
    deepseek_v3.chat_template = template
    assert training_chat_template(deepseek_v3) is None, "the training template needs no patch"
