"""How a conversation becomes the token ids a server is sent: one chat-template rendering, used by the rollout
loop (what is generated), the trainer (the prompt-length check, the sync probe), `tandem train --dry-run`,
`tandem serve`'s chat endpoint and `tandem proxy`'s routing, so that all of them agree by construction.

Only the tokenizer is needed here (no torch), so the proxy can use it too.
"""

import functools

import jinja2

from tandem.errors import UsageError

TEMPLATE_ERRORS = (jinja2.TemplateError, ValueError, TypeError, KeyError)
"""What a chat template raises for messages it refuses (a caller's input error, not a bug of ours)."""


def check_conversational(prompt, where: str) -> None:
    """A dataset row's prompt is a non-empty list of {'role', 'content'} messages; anything else is the user's mistake,
    named with `where` (the dataset and the row)."""
    if not (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
    ):
        raise UsageError(
            f"{where}: 'prompt' must be conversational, a list of {{'role': ..., 'content': ...}} messages; "
            f"got {type(prompt).__name__} {str(prompt)[:80]!r}. Wrap plain text as "
            "[{'role': 'user', 'content': text}]."
        )


def render_chat(
    tokenizer,
    messages: list[dict],
    *,
    tools: list | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    chat_template_kwargs: dict | None = None,
    content_format: str = "auto",
    add_special_tokens: bool = False,
) -> list[int]:
    """`messages` through the chat template as vLLM's chat endpoint renders them: with the tools and template
    options, without a generation prompt when the last message is continued, with each message's content in the
    form the template reads (`content_format`, as vLLM's `--chat-template-content-format`), and the rendered text
    tokenized with the tokenizer's special tokens when asked."""
    template = chat_template or tokenizer.get_chat_template(chat_template, tools)
    form = template_content_format(template) if content_format == "auto" else content_format
    rendered = tokenizer.apply_chat_template(
        [with_content_as(message, form) for message in messages],
        tools=tools,
        add_generation_prompt=add_generation_prompt and not continue_final_message,
        continue_final_message=continue_final_message,
        chat_template=chat_template,
        tokenize=not add_special_tokens,
        return_dict=False,
        **(chat_template_kwargs or {}),
    )
    return tokenizer(rendered, add_special_tokens=True)["input_ids"] if add_special_tokens else list(rendered)


CONTENT_FORMATS = ("auto", "string", "openai")
"""How a template reads a message's content: "string" (one text) or "openai" (a list of typed parts)."""


@functools.lru_cache(maxsize=32)
def template_content_format(template: str) -> str:
    """ "openai" when the template loops over a message's content (its parts), else "string": vLLM's detection, read
    from the template's syntax tree. A template that does not parse is rendered with strings."""
    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"
    messages = {"messages"} | {
        node.target.name
        for node in tree.find_all(jinja2.nodes.For)
        if _reads(node.iter, {"messages"}) and isinstance(node.target, jinja2.nodes.Name)
    }
    contents = {
        node.target.name
        for node in tree.find_all(jinja2.nodes.Assign)
        if isinstance(node.target, jinja2.nodes.Name) and _content_of(node.node, messages)
    }
    for loop in tree.find_all(jinja2.nodes.For):
        if _content_of(loop.iter, messages) or _reads(loop.iter, contents):
            return "openai"
    return "string"


def _reads(node, names: set[str]) -> bool:
    """`node` is one of `names`, an item of it (messages[0]) or it filtered (messages | selectattr(...))."""
    while isinstance(node, (jinja2.nodes.Getitem, jinja2.nodes.Filter)) and node.node is not None:
        node = node.node
    return isinstance(node, jinja2.nodes.Name) and node.name in names


def _content_of(node, messages: set[str]) -> bool:
    """`node` reads a message's content: `message['content']` or `message.content` (possibly filtered)."""
    while isinstance(node, jinja2.nodes.Filter) and node.node is not None:
        node = node.node
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const):
        return node.arg.value == "content" and _reads(node.node, messages)
    return isinstance(node, jinja2.nodes.Getattr) and node.attr == "content" and _reads(node.node, messages)


def with_content_as(message: dict, form: str) -> dict:
    """A message whose content is a list of parts, as the template reads it: the text parts joined by newlines for a
    "string" template (vLLM's join), typed parts for an "openai" one; a text content is wrapped in one part for the
    latter. A part that is not text (an image) is refused: tandem renders text only."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str) and form == "openai":
        return {**message, "content": [{"type": "text", "text": content}]}
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        text = part.get("text") if isinstance(part, dict) and part.get("type", "text") == "text" else part
        if not isinstance(text, str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(
                f'a content part of type {kind!r}: tandem renders text parts only ([{{"type": "text", "text": ...}}])'
            )
        texts.append(text)
    if form == "openai":
        return {**message, "content": [{"type": "text", "text": text} for text in texts]}
    return {**message, "content": "\n".join(texts)}


def render_prompt(tokenizer, messages: list[dict], chat_template_kwargs: dict | None = None) -> list[int]:
    """A training prompt as the rollout worker sends it: the chat template with the generation prompt added."""
    return render_chat(tokenizer, messages, chat_template_kwargs=chat_template_kwargs)


# --- Multi-turn rollouts: is the chat template prefix-preserving? -----------------------------------------------
# A tool loop renders the growing conversation again before each turn. Its tokens can be trained as one
# sequence only when each turn's prompt is a token prefix of the next one: a template that re-renders earlier
# turns differently (Qwen3 drops their reasoning) forks the rollout into one training sequence per turn.

PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "The expression"}},
            "required": ["expression"],
        },
    },
}
"""The tool of the probe conversation, for callers with no tools of their own."""


def probe_conversation(with_reasoning: bool) -> list[dict]:
    """Question → tool call → tool result → answer → question → answer: one tool loop, and a second question
    after it (where Qwen3 drops the earlier replies' reasoning). The replies carry reasoning when the model would
    write some."""
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2 + 3"}}}
    messages: list[dict] = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "2 + 3 = 5."},
        {"role": "user", "content": "And 5 + 5?"},
        {"role": "assistant", "content": "10."},
    ]
    if with_reasoning:
        replies = [m for m in messages if m["role"] == "assistant"]
        reasonings = ("I should use the calculator.", "The calculator says 5.", "That is easy.")
        for reply, reasoning in zip(replies, reasonings):
            reply["reasoning_content"] = reasoning
    return messages


def check_prefix_preserving(
    tokenizer, tools: list[dict] | None, chat_template_kwargs: dict | None, *, chat_template: str | None = None
) -> str | None:
    """None when the chat template is prefix-preserving on a probe conversation, else a one-line reason.

    Each assistant turn's prompt (the conversation before it, with the generation prompt) must be a token prefix
    of the whole conversation rendered at once. The probe's replies carry reasoning unless the generation prompt
    already closes the reasoning block (Qwen3 with `enable_thinking=False`), since then the model writes none.
    """

    def render(messages: list[dict], add_generation_prompt: bool) -> list[int]:
        return render_chat(
            tokenizer,
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
        )

    try:
        first_prompt = tokenizer.decode(render(probe_conversation(False)[:1], True))
        messages = probe_conversation(with_reasoning=not first_prompt.rstrip().endswith("</think>"))
        whole = render(messages, False)
        for turn, k in enumerate((k for k, m in enumerate(messages) if m["role"] == "assistant"), start=1):
            prompt = render(messages[:k], True)
            if whole[: len(prompt)] != prompt:
                return (
                    f"the prompt of reply {turn} in a probe conversation (question, tool call, tool result, "
                    f"answer, question, answer) {prefix_mismatch(tokenizer, prompt, whole)}"
                )
    except TEMPLATE_ERRORS as e:
        return f"the chat template cannot render a tool-calling probe conversation: {' '.join(str(e).split())}"
    return None


def prefix_mismatch(tokenizer, prompt: list[int], whole: list[int]) -> str:
    """Where `prompt` stops being a prefix of `whole`, as text on one line."""
    at = next((i for i, (a, b) in enumerate(zip(prompt, whole)) if a != b), len(whole))
    return (
        f"is not a token prefix of the whole conversation: from token {at} the prompt has "
        f"{tokenizer.decode(prompt[at:])[:40]!r} where the conversation has {tokenizer.decode(whole[at:])[:40]!r}"
    )


QWEN3_MARKERS = ("<|im_start|>", "<tool_call>", "reasoning_content", "</think>", "last_query_index", "enable_thinking")
"""What Qwen3's hybrid-thinking template (Qwen3-0.6B ... Qwen3-235B-A22B) contains: ChatML turns, JSON tool calls,
and reasoning dropped from the turns before the last user query. Qwen3.5 and Qwen3-Coder write XML tool calls
(`<function=`) and are not this family."""

QWEN3_TRAINING_TEMPLATE = r"""{#- Qwen3 for training: every assistant turn renders as Qwen3's template renders the last one, <think> block
    included, so a longer conversation extends a shorter one token for token. -#}
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
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{%- set content = message.content if message.content is string else '' %}
{%- set reasoning = '' %}
{%- if message.reasoning_content is string %}
{%- set reasoning = message.reasoning_content %}
{%- elif '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\n') %}
{%- endif %}
{{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
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
"""Qwen3's format with no turn rewritten later: the last assistant turn renders exactly as in Qwen3's own
template; earlier turns keep their reasoning (Qwen3's drops it once a new user question follows) and their
`<think>` block (Qwen3's drops an empty one from turns that are no longer last)."""


DEEPSEEK_V3_MARKERS = ("<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁outputs▁begin｜>", "is_output_first")
"""What DeepSeek-V3's template contains: its turn tokens, tool calls opened once per conversation (`ns.is_first`
is never reset) and tool outputs opened once (`is_output_first`)."""

DEEPSEEK_V3_TRAINING_TEMPLATE = r"""{#- DeepSeek-V3 for training: each reply renders as it was generated after its prompt (reasoning kept, each reply
    opening its own tool-call list, each run of tool results opened and closed), so a longer conversation extends a
    shorter one token for token; tool arguments may be objects. -#}
{%- set reply_start = '<｜Assistant｜><think>\n' %}
{%- set output_separator = '' %}
{%- set ns = namespace(system='', after_tools=false) %}
{%- for message in messages if message.role == 'system' %}
{%- set ns.system = ns.system + ('\n\n' if ns.system else '') + message.content %}
{%- endfor %}
{{- (bos_token or '') + ns.system }}
{%- for message in messages %}
{%- if message.role == 'user' %}
{{- '<｜User｜>' + message.content }}
{%- set ns.after_tools = false %}
{%- elif message.role == 'assistant' %}
{%- set content = message.content if message.content is string else '' %}
{%- if message.reasoning_content is string %}
{%- set opened = not ns.after_tools and reply_start.endswith('<think>\n') %}
{%- set content = ('' if opened else '<think>\n') + message.reasoning_content + '</think>' + content %}
{%- endif %}
{#- after the user, the prompt ended with reply_start; after tool results, with the tool outputs' end -#}
{{- ('' if ns.after_tools else reply_start) + content }}
{%- if message.tool_calls %}
{{- '<｜tool▁calls▁begin｜>' }}
{%- for tool_call in message.tool_calls %}
{%- set call = tool_call.function if tool_call.function is defined else tool_call %}
{%- if not loop.first %}{{- '\n' }}{%- endif %}
{{- '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + call.name + '\n```json\n' }}
{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}
{{- '\n```<｜tool▁call▁end｜>' }}
{%- endfor %}
{{- '<｜tool▁calls▁end｜>' }}
{%- endif %}
{{- '<｜end▁of▁sentence｜>' }}
{%- set ns.after_tools = false %}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<｜tool▁outputs▁begin｜>' }}
{%- else %}{{- output_separator }}{%- endif %}
{{- '<｜tool▁output▁begin｜>' + message.content + '<｜tool▁output▁end｜>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<｜tool▁outputs▁end｜>' }}{%- endif %}
{%- set ns.after_tools = true %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt and not ns.after_tools %}{{- reply_start }}{%- endif %}
"""
"""DeepSeek-V3's format with no turn rewritten later: its own template drops an earlier reply's reasoning, opens
the tool-call list and the tool outputs only once per conversation, prefixes a reply that follows tool results with
`<｜Assistant｜>` although its prompt ended without one, and cannot render object arguments."""


def deepseek_v3_training_template(source: str) -> str:
    """The training template in the variant of `source`: DeepSeek-V3 checkpoints differ in whether the generation
    prompt opens a `<think>` block and whether tool outputs after the first are separated by a newline."""
    thinks = "'<｜Assistant｜><think>\\n'" in source
    separated = "'\\n<｜tool▁output▁begin｜>'" in source
    return DEEPSEEK_V3_TRAINING_TEMPLATE.replace(
        "{%- set reply_start = '<｜Assistant｜><think>\\n' %}",
        "{%- set reply_start = '<｜Assistant｜>" + ("<think>\\n" if thinks else "") + "' %}",
    ).replace(
        "{%- set output_separator = '' %}", "{%- set output_separator = '" + ("\\n" if separated else "") + "' %}"
    )


TRAINING_TEMPLATES = {
    "qwen3": (QWEN3_MARKERS, lambda source: QWEN3_TRAINING_TEMPLATE),
    "deepseek_v3": (DEEPSEEK_V3_MARKERS, deepseek_v3_training_template),
}


def training_chat_template(tokenizer) -> tuple[str, str] | None:
    """(family, template) when the tokenizer's chat template is of a known family (Qwen3, DeepSeek-V3) and not
    prefix-preserving: a template of the same format that is, to render multi-turn rollouts with (`chat_template=`
    or assign it to `tokenizer.chat_template`). None when the template is prefix-preserving already, or of a family
    with no training template here."""
    source = tokenizer.chat_template
    if not isinstance(source, str) or "<function=" in source:  # Qwen3.5 / Qwen3-Coder: XML tool calls, not Qwen3's
        return None
    family = next(
        (name for name, (markers, _) in TRAINING_TEMPLATES.items() if all(m in source for m in markers)), None
    )
    if family is None or check_prefix_preserving(tokenizer, [PROBE_TOOL], None) is None:
        return None
    return family, TRAINING_TEMPLATES[family][1](source)
