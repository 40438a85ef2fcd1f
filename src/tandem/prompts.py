"""How a conversational prompt becomes the token ids the server is sent: one function, used by the rollout
loop (what is generated), the trainer (the prompt-length check, the sync probe) and `tandem train --dry-run`,
so that the length check is right by construction."""


def render_prompt(tokenizer, messages: list[dict], chat_template_kwargs: dict | None = None) -> list[int]:
    """The chat template applied to `messages` with the generation prompt added, as token ids."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                              **(chat_template_kwargs or {})))
