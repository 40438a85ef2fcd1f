"""How a conversation becomes the token ids a server is sent: one chat-template rendering, used by the rollout
loop (what is generated), the trainer (the prompt-length check, the sync probe), `tandem train --dry-run`,
`tandem serve`'s chat endpoint and `tandem proxy`'s routing, so that all of them agree by construction.

Only the tokenizer is needed here (no torch), so the proxy can use it too.
"""

import jinja2

TEMPLATE_ERRORS = (jinja2.TemplateError, ValueError, TypeError, KeyError)
"""What a chat template raises for messages it refuses (a caller's input error, not a bug of ours)."""


def render_chat(tokenizer, messages: list[dict], *, tools: list | None = None, add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template: str | None = None,
                chat_template_kwargs: dict | None = None) -> list[int]:
    """`messages` through the chat template as vLLM's chat endpoint renders them: with the tools and template
    options, and without a generation prompt when the last message is continued."""
    return list(tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt and not continue_final_message,
        continue_final_message=continue_final_message, chat_template=chat_template, tokenize=True, return_dict=False,
        **(chat_template_kwargs or {})))


def render_prompt(tokenizer, messages: list[dict], chat_template_kwargs: dict | None = None) -> list[int]:
    """A training prompt as the rollout worker sends it: the chat template with the generation prompt added."""
    return render_chat(tokenizer, messages, chat_template_kwargs=chat_template_kwargs)
