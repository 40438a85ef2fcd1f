"""Build the project's tiny model: tokenizer, chat template, Qwen2 weights pretrained on arithmetic.

Run once (a few minutes on 2 CPU cores); the result is shipped in src/tandem/tasks/tiny_model/.
Pretraining stops as soon as the pass rate on held-out problems, sampled at temperature 1.0, lies in
[--min-pass, --max-pass], so the model is competent but leaves RL room to improve.

    python scripts/build_tiny_model.py [--out DIR] [--seed 0]
"""

import argparse
import random
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from tandem.tasks import TINY_MODEL_PATH, arithmetic

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# Qwen-style template: system / user / assistant / tool messages, a `tools` list, and
# <tool_call>{json}</tool_call> blocks for assistant tool calls. Each turn renders the same way
# wherever it sits, so a longer conversation always extends the shorter one's tokens.
CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if message.content %}{{- message.content }}{%- endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- set call = tool_call.function if tool_call.function is defined else tool_call %}
{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def training_texts(rng: random.Random, n: int) -> list[str]:
    """Text for the tokenizer: arithmetic chats plus the tool-calling vocabulary of the template."""
    texts = []
    for _ in range(n):
        p = rng.choice(arithmetic.all_problems())
        texts.append(f"user\n{arithmetic.question(p)}\nassistant\n{arithmetic.answer(p)}\n")
    texts.append(CHAT_TEMPLATE)
    texts += ['{"name": "calculator", "arguments": {"expression": "1 + 2"}}', "system\nYou are a helpful assistant."]
    return texts


def build_tokenizer(rng: random.Random) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=SPECIAL_TOKENS + TOOL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(training_texts(rng, 4000), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"], model_max_length=1024,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(tokenizer: PreTrainedTokenizerFast) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=192, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=True, rope_theta=10000.0,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen2ForCausalLM(config)


def encode_example(tokenizer, problem) -> tuple[list[int], int]:
    """Token ids of a full chat and the index where the assistant's answer starts."""
    messages = [{"role": "user", "content": arithmetic.question(problem)}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    reply = tokenizer.encode(str(arithmetic.answer(problem)), add_special_tokens=False) + [tokenizer.eos_token_id]
    return list(prompt) + reply, len(prompt)


def batch(tokenizer, problems):
    encoded = [encode_example(tokenizer, p) for p in problems]
    width = max(len(ids) for ids, _ in encoded)
    input_ids = torch.full((len(encoded), width), tokenizer.pad_token_id)
    labels = torch.full((len(encoded), width), -100)
    for row, (ids, start) in enumerate(encoded):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, start : len(ids)] = torch.tensor(ids[start:])
    return input_ids, labels


@torch.no_grad()
def pass_rate(model, tokenizer, problems) -> float:
    """Fraction of problems answered correctly when sampling at temperature 1.0."""
    model.eval()
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": arithmetic.question(p)}], add_generation_prompt=True, tokenize=False)
        for p in problems
    ]
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(
        **enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=8,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    model.train()
    return sum(arithmetic.is_correct(t, str(arithmetic.answer(p))) for t, p in zip(texts, problems)) / len(problems)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=TINY_MODEL_PATH)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-pass", type=float, default=0.35)
    parser.add_argument("--max-pass", type=float, default=0.55)
    parser.add_argument("--max-steps", type=int, default=6000)
    parser.add_argument("--activation-penalty", type=float, default=1e-3, help="weight of the mean squared hidden state in the loss")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    tokenizer = build_tokenizer(rng)
    model = build_model(tokenizer)
    print(f"tokenizer: {len(tokenizer)} tokens; model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")

    train = [p for p in arithmetic.all_problems() if arithmetic.split_of(p) == "train"]
    held_out = [p for p in arithmetic.all_problems() if arithmetic.split_of(p) == "test"]
    eval_set = random.Random(1).sample(held_out, 400)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    start, rate = time.time(), 0.0
    for step in range(1, args.max_steps + 1):
        input_ids, labels = batch(tokenizer, [rng.choice(train) for _ in range(128)])
        out = model(input_ids=input_ids, labels=labels, output_hidden_states=True)
        # Keep the residual stream small: fp32 rounding noise grows with activation size, and the
        # exactness tests compare cached decoding against a full forward at 1e-5.
        penalty = sum(h.pow(2).mean() for h in out.hidden_states[1:])
        loss = out.loss + args.activation_penalty * penalty
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step % 50 == 0:
            rate = pass_rate(model, tokenizer, eval_set)
            print(f"step {step:5d}  loss {out.loss.item():.3f}  max |hidden| {max(h.abs().max().item() for h in out.hidden_states):.1f}  held-out pass rate {rate:.3f}  ({time.time() - start:.0f}s)", flush=True)
            if args.min_pass <= rate <= args.max_pass:
                break
            if rate > args.max_pass:
                raise SystemExit(f"pass rate {rate:.3f} overshot {args.max_pass}: evaluate more often or lower the lr")
    else:
        raise SystemExit(f"pass rate {rate:.3f} never reached [{args.min_pass}, {args.max_pass}] in {args.max_steps} steps")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.config.dtype = torch.float32
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    GenerationConfig(eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id], pad_token_id=tokenizer.pad_token_id).save_pretrained(out)
    print(f"saved to {out} (held-out pass rate {rate:.3f})")


if __name__ == "__main__":
    main()
