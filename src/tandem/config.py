"""`AsyncGRPOConfig`: every knob of a run as plain values, with TRL's names and defaults.

Fields that tandem does not implement are absent (passing one is a TypeError naming it), transformers' fields it
does not run are accepted at their defaults only, and every value is checked up front (`config_checks.py`), so a bad
one fails before any process starts, with the fix in the message. The YAML recipes of `tandem train` are read in
`recipe.py`.
"""

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from tandem.config_checks import validate
from tandem.contract.staleness import StalenessPolicy


@dataclass
class AsyncGRPOConfig:
    # ---- run and optimisation ----
    output_dir: str = "runs/tandem"
    """The run's folder: checkpoints (checkpoint-N), metrics.jsonl, completions.jsonl and the embedded server's log.
    resume_from_checkpoint=True resumes from its latest checkpoint, so give each new run a folder of its own."""
    per_device_train_batch_size: int | None = None
    """Samples per packed row at most (1: one sample per row, the reference recipe's layout). None: as many as the
    token budget holds, sharing their prompts: tandem's default, unlike transformers' 8 (docs/references/config.md)."""
    num_train_epochs: float = 3.0
    """Passes over the prompt dataset (filtered and dropped prompts count). Ignored when max_steps > 0."""
    max_steps: int = -1
    """Optimizer steps to train; -1 (or 0): stop after num_train_epochs passes over the prompts. Needed by decaying
    schedules, intervals below 1, an IterableDataset and environments without a dataset (they have no epochs)."""
    learning_rate: float = 1e-6
    """The optimizer's peak learning rate (after warm-up). Default 1e-6, as in TRL: RL moves a pretrained model in small
    steps. LoRA adapters usually take a larger one; lower it if rewards collapse or grad_norm spikes."""
    lr_scheduler_type: str = "constant"
    """Any of transformers' schedule names (constant, linear, cosine, cosine_with_min_lr, ...); decaying ones need max_steps."""
    lr_scheduler_kwargs: dict | str | None = None
    """Extra arguments of the schedule (e.g. {"min_lr_rate": 0.1} for cosine_with_min_lr); also a JSON string."""
    warmup_steps: float = 0
    """Steps of linear warm-up; a value below 1 is a fraction of max_steps."""
    optim: str = "adamw_torch_fused"
    """An optimizer of transformers' `optim` names: adamw_torch, adamw_torch_fused, adafactor, sgd, adagrad, rmsprop, ..."""
    optim_args: str | None = None
    """More optimizer arguments, transformers' way: "momentum=0.9,nesterov=True"."""
    optim_target_modules: str | list[str] | None = None
    """The modules the low-rank optimizers (optim galore_* / apollo_*: the `galore` extra) project, as
    transformers takes them (names or regexes, e.g. ["attn", "mlp"])."""
    weight_decay: float = 0.0
    """The optimizer's weight decay (decoupled in AdamW), pulling weights toward 0 each step; applied as transformers
    does, not to biases and normalisation weights. Default 0: raise it (e.g. 0.01) only to regularise long runs."""
    adam_beta1: float = 0.9
    """β1 of the Adam-family optimizers: how fast the gradient's running mean forgets. Default 0.9, transformers'."""
    adam_beta2: float = 0.999
    """β2 of the Adam-family optimizers: the decay per step of the squared gradient's running mean. Default 0.999,
    transformers'; a lower value (e.g. 0.99) lets the step size follow a changing gradient scale sooner."""
    adam_epsilon: float = 1e-8
    """ε of the Adam-family optimizers, added to the update's denominator for numerical stability. Rarely changed."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step; a micro-batch is one packed row of up to token_budget tokens per rank. Raise it
    for more samples per update (a steadier gradient, fewer weight syncs per sample). Refused beside flash_batch_size, which sets the step."""
    max_grad_norm: float = 1.0
    """Clip the gradients' global L2 norm to this before each optimizer step; 0 or None: no clipping (as in
    transformers). grad_norm logs the norm before clipping; lower this if it spikes."""
    bf16: bool | None = None
    """Autocast the trainer's forward to bfloat16. Default: on with CUDA, off on CPU (where it is slow)."""
    fp16: bool = False
    """Autocast the trainer's forward to float16 with a gradient scaler (one CUDA process; refused on CPU)."""
    tf32: bool | None = None
    """Let CUDA matmuls use TensorFloat-32 (Ampere or newer). None: torch's default. Refused on CPU."""
    gradient_checkpointing: bool = True
    """Recompute each layer's activations in the backward pass instead of keeping them: much less memory for about one
    more forward of compute. Default True, as in TRL; turn it off for speed when the rows fit in memory without it."""
    gradient_checkpointing_kwargs: dict | str | None = None
    """Passed to gradient_checkpointing_enable (default {"use_reentrant": False}); also a JSON string."""
    use_cpu: bool = False
    """Train on the CPU even where CUDA is available."""
    logging_strategy: str = "steps"
    """steps | epoch (when a pass over the dataset ends) | no (no periodic log; the run's last window is still logged)."""
    logging_steps: float = 1
    """Log every this many steps; below 1, a fraction of max_steps (transformers' convention)."""
    logging_first_step: bool = False
    """Log after the first step too, whatever logging_steps says."""
    logging_nan_inf_filter: bool = True
    """True (transformers' default): a step whose loss is NaN or infinite is left out of the logged `loss` (and of
    train()'s training_loss). False: the window's `loss` and training_loss are that value, so a diverging run shows it."""
    include_num_input_tokens_seen: str | bool = "no"
    """Log `num_input_tokens_seen`, the tokens the trainer has forwarded since the run started (transformers' name):
    "all" (or True) counts every forwarded token, padding included; "non_padding" leaves a padded row's padding out;
    "no" (or False) logs nothing. `num_tokens` is logged either way."""
    log_level: str = "passive"
    """transformers' logging level while training on the main process: passive (unchanged), debug, info, warning, error, critical."""
    log_level_replica: str = "warning"
    """log_level for the other torchrun processes (see log_on_each_node). Default warning, transformers': one process
    speaks, the others only warn."""
    log_on_each_node: bool = True
    """Under torchrun on several machines, each machine's first process takes log_level too (False: the first
    process of the whole job only). Metrics are gathered and written once, by rank 0, either way."""
    disable_tqdm: bool | None = None
    """True: plain log lines instead of the live dashboard. None: the dashboard in a terminal, lines elsewhere."""
    report_to: str | list[str] | None = "none"
    """Extra metric sinks: trackio, tensorboard, wandb (offline). metrics.jsonl is always written."""
    run_name: str | None = None
    """The run's name in wandb and trackio (None: the tracker picks one). Does not change output_dir."""
    project: str = "huggingface"
    """The trackio and wandb project the run is logged under."""
    trackio_space_id: str | None = None
    """trackio: the Hugging Face Space that hosts the dashboard (None: local only)."""
    trackio_bucket_id: str | None = None
    """trackio: the Hugging Face bucket its data syncs to."""
    trackio_static_space_id: str | bool | None = None
    """trackio: a static Space to publish the dashboard to (False: none)."""
    save_strategy: str = "steps"
    """steps | epoch | best (whenever an evaluation beats the best so far) | no. Checkpoints are also written at the
    end of training unless 'no'."""
    save_steps: float = 500
    """Checkpoint every this many steps; below 1, a fraction of max_steps."""
    save_total_limit: int | None = None
    """Keep the newest this many checkpoints (and always the best one, see metric_for_best_model)."""
    save_only_model: bool = False
    """Checkpoints hold the model only (no optimizer, schedule or rollout queue): smaller, but no run resumes from one."""
    save_on_each_node: bool = False
    """Under torchrun on several machines, each machine's first process writes the checkpoint's files (for machines
    without a shared filesystem). On one machine rank 0 writes them either way; several machines are not supported
    yet, and a run that sets it there stops with that message."""
    load_best_model_at_end: bool = False
    """When training ends, load the weights of the best checkpoint (by metric_for_best_model) into the model."""
    metric_for_best_model: str | None = None
    """The eval/* metric that ranks checkpoints ('reward' or 'eval/reward'; the default with load_best_model_at_end).
    A step whose evaluation is the best so far is always checkpointed, whatever save_steps says."""
    greater_is_better: bool | None = None
    """Whether a larger metric_for_best_model is better. None: True, unless the name ends in 'loss'."""
    restore_callback_states_from_checkpoint: bool = False
    """On resume, rebuild the callbacks that export their state (transformers' ExportableState, e.g.
    EarlyStoppingCallback) from the checkpoint's trainer_state.json."""
    push_to_hub: bool = False
    """Upload the model to the Hugging Face Hub (hub_model_id) at each checkpoint and when training ends, in the
    background: a failed upload warns and is tried again at the next one."""
    hub_model_id: str | None = None
    """The repository to push to (None: the name of output_dir under the token's user)."""
    hub_strategy: str = "every_save"
    """end (the final model only) | every_save (the model at each checkpoint) | checkpoint (also the latest whole
    checkpoint, in last-checkpoint/) | all_checkpoints (every checkpoint in its own folder)."""
    hub_token: str | None = None
    """Write token (None: $HF_TOKEN or the saved login). Never written to disk or logs."""
    hub_private_repo: bool | None = None
    """Create the repository private (None: the account's default)."""
    hub_always_push: bool = False
    """Upload at every checkpoint even while the previous upload runs (False: skip a checkpoint's upload then)."""
    hub_revision: str | None = None
    """The branch to push to (created if missing; None: main)."""
    enable_jit_checkpoint: bool = False
    """On SIGTERM (a preemption notice), finish the step in progress, write a checkpoint and stop, so the job resumes
    where it stopped (default off, as in transformers: SIGTERM then ends the process at once)."""
    resume_from_checkpoint: bool | str | None = None
    """train()'s default: True (the latest checkpoint in output_dir) or a checkpoint folder."""
    seed: int = 42
    """Seeds the trainer's torch random state and, with each prompt's index, the seed of every generation request,
    so a rerun or a resumed run sends each prompt's requests with the same seeds. data_seed defaults to it."""
    data_seed: int | None = None
    """The seed of the prompt order with train_sampling_strategy 'random' (None: seed)."""
    train_sampling_strategy: str = "random"
    """random (a new order each epoch, drawn from data_seed: the same on every resume) | sequential (the dataset's
    order, every epoch). An IterableDataset is read as it streams either way."""
    full_determinism: bool = False
    """Deterministic algorithms in the trainer (transformers' enable_full_determinism); the server samples as ever."""
    remove_unused_columns: bool = False
    """True: drop the dataset columns no reward function names (keep False when a reward takes **kwargs)."""
    model_init_kwargs: dict | str | None = None
    """Extra keyword arguments for from_pretrained when the model is a path or hub id (e.g. {"attention_dropout": 0.0});
    they take precedence over dtype and trust_remote_code. Also a JSON string. Not read for a model object."""
    dtype: str = "float32"
    """The dtype of the weights loaded from a path: float32, bfloat16, float16 or auto (the checkpoint's); the embedded
    server samples in the weights' dtype. Default float32: trainer and sampler log-probs agree most closely; bfloat16
    halves the memory at the cost of a wider sampler/trainer gap."""
    trust_remote_code: bool = False
    """Load models and tokenizers that ship their own code (the trainer's and the embedded server's)."""
    router_aux_loss_coef: float | None = None
    """Mixture-of-Experts models only: the weight of the router's load-balancing loss added to the RL loss. None: the
    model config's own router_aux_loss_coef (0 when it has none). Setting it on a model without a router is an error."""
    torch_compile: bool = False
    """Compile the decoder with torch.compile, dynamic shapes (a packed row's length changes every step: one compile,
    not one per length). One process only; its fused kernels round differently from `tandem serve --decode-mode
    exact`, so the staleness-0 ratio is 1 to ~1e-5, not exactly 1."""
    torch_compile_backend: str | None = None
    """The backend torch.compile uses with torch_compile on (None: inductor, its default); "eager" or "aot_eager" to
    tell a compiler problem from a model one."""
    torch_compile_mode: str | None = None
    """torch.compile's mode (None: its default; "max-autotune", "reduce-overhead", ...)."""
    torch_empty_cache_steps: int | None = None
    """Empty the accelerator's memory cache every this many steps (a little slower, less fragmentation; None: never)."""
    debug: str | list[str] = ""
    """transformers' debug options: "underflow_overflow" stops training at the first inf or NaN in any module's
    activations or weights, with a report of the frames before it (transformers' DebugUnderflowOverflow; slow)."""
    skip_memory_metrics: bool = True
    """False: log memory/host_rss_max_gib (the trainer process) and, on a GPU, memory/cuda_max_allocated_gib per window."""
    ddp_timeout: int = 1800
    """Seconds a torchrun collective may wait before the run fails (the other ranks wait this long while rank 0
    waits for the server and for samples)."""
    fsdp_config: dict | str | None = None
    """Under torchrun (FSDP2): {"reshard_after_forward": bool} (default true; false keeps each layer's gathered
    weights from its forward to its backward: more memory, one all-gather fewer); as in transformers, also a JSON
    string or the path of a JSON file."""

    # ---- generation ----
    num_generations: int = 8
    """Rollouts sampled per prompt (a group). GRPO compares them: advantages are rewards standardised within the group,
    and a group whose rewards are all equal is dropped; so at least 2 (FlashREINFORCE: exactly 1). Raise it when
    rewards are sparse (more groups with both successes and failures); eval prompts get as many."""
    max_completion_length: int = 2048
    """Tokens the model may generate per turn (each turn of a tool-calling rollout gets this many), never past the
    server's context. Raise it when many completions are cut off (completions/clipped_ratio); lower it to save time."""
    temperature: float = 1.0
    """Sampling temperature of every request; the trainer divides its logits by it too, so its log-probs match the
    sampler's. In (0, 2]: RL needs sampling, not greedy decoding. Default 1: the model's own distribution."""
    top_p: float = 1.0
    """Nucleus sampling: keep the most likely tokens up to this probability mass (1: off). Below 1 it needs top_k too,
    and a server that returns each token's kept set, so the trainer renormalises its log-probs over it."""
    top_k: int = 0
    """Sample from the k most likely tokens only (0: off). Any truncation (top_k, top_p < 1, min_p) needs sampling masks
    from the server (`tandem serve`, `vllm serve --return-sampling-mask --enable-scale-out`), else ratios are biased."""
    min_p: float | None = None
    """Drop tokens less likely than min_p times the most likely one (None or 0: off; 0 is stored as None). Like top_p,
    it needs top_k set and a server that returns sampling masks."""
    repetition_penalty: float = 1.0
    """The repetition penalty of every request, as vLLM applies it (1: off; above 1 discourages repeats). The sampler's
    log-probs include it and the trainer's do not, so any other value biases the importance ratio: keep 1 if you can."""
    chat_template_kwargs: dict | str | None = None
    """Extra keyword arguments for the tokenizer's apply_chat_template when prompts are rendered, e.g.
    {"enable_thinking": False} for Qwen3. Also a JSON string."""
    max_tool_calling_iterations: int | None = None
    """Tool-calling turns per rollout at most; None: until a reply calls no tool."""
    tool_call_timeout: float = 60.0
    """Seconds one tool call may take; a late call is an error message to the model and a failure. tandem's own field."""
    tool_call_parser: str | None = None
    """The format the rollout loop reads tool calls in, by vLLM's parser names (hermes, llama3_json, mistral,
    deepseek_v3, granite, pythonic), as `tandem serve` and `vllm serve --tool-call-parser` read it (hermes block by
    block: a malformed block is reported to the model, the others run); None: Hermes `<tool_call>` blocks, else the
    tokenizer's `response_template`. tandem's own field."""

    # ---- the generation server ----
    vllm_server_base_url: str | None = None
    """URL of `vllm serve` / `tandem serve` / `tandem proxy`. None: start `tandem serve` for the model."""
    vllm_server_timeout: float = 1800.0
    """Seconds to wait for the generation server: to answer /health at start, for one request or weight transfer, and
    for a server that went away to come back before the run stops. Default 1800 (30 minutes), room for a large model's
    start; lower it to fail sooner."""
    vllm_server_api_key: str | None = None
    """Sent as `Authorization: Bearer KEY` to a server started with --api-key. None: $VLLM_API_KEY if set. tandem's own."""
    vllm_server_host: str | None = None
    """With vllm_server_port, as in TRL: generate from the server at http://HOST:PORT (host 0.0.0.0, port 8000 when only
    the other is given). vllm_server_base_url says the same in one value."""
    vllm_server_port: int | None = None
    """TRL's port of the server to generate from, with vllm_server_host (8000 when only the host is given)."""
    embedded_server_host: str = "127.0.0.1"
    """The embedded tandem serve's bind address. The rollout worker, on this machine, reaches it on loopback; 0.0.0.0 (or
    one of this machine's addresses) lets clients on other machines generate from it too. tandem's own."""
    weight_transfer_address: str | None = None
    """Where servers with a weight-transfer backend reach the trainer's rank 0 to join its transfer group: an address of
    this machine they can connect to. None: the address this machine's route to the server leaves from (loopback for a
    server on this machine); set it when the servers reach this machine by another address. tandem's own."""

    # ---- the loss ----
    algorithm: str = "grpo"
    """"grpo", or "flash_reinforce" (one rollout per prompt, batch-mean baseline, Sequence Trust Region)."""
    flash_delta: float = 3e-3
    """FlashREINFORCE only: a trajectory trains only if its mean Bernoulli KL to the sampler is at most this."""
    flash_negative_token_fraction: float = 1.0
    """FlashREINFORCE only: failed trajectories (reward <= 0) keep only this fraction of their tokens, the
    highest-entropy ones."""
    flash_batch_size: int | None = None
    """FlashREINFORCE's B: each step trains exactly this many trajectories, in as many micro-batches as token_budget
    needs (gradient_accumulation_steps is then refused). None: gradient_accumulation_steps micro-batches of full rows."""
    epsilon: float = 0.2
    """Lower bound of the trust region [1 - epsilon, 1 + epsilon_high] on a token's policy/sampler probability ratio.
    score_centering=False: it clips the surrogate, as in TRL's GRPO; under score centering it only sets clip_ratio/*."""
    epsilon_high: float | None = None
    """Upper bound of the trust region: 1 + epsilon_high (None: epsilon). DAPO uses 0.28 so that unlikely tokens can
    grow more. Like epsilon, it changes the loss only with score_centering=False."""
    score_centering: bool = True
    """True (default): subtract from each sampled token's importance-weighted score its expectation over the sampler's
    top num_sampler_logprobs tokens, so a constant advantage does not pull the policy toward the sampler. False: TRL's
    clipped surrogate with epsilon and epsilon_high. GRPO only (refused under FlashREINFORCE)."""
    vllm_importance_sampling_clip_min: float = 0.5
    """C_min: tokens whose policy/sampler probability ratio falls below this are masked out of the loss, not clipped
    (sampling/masked_mean counts them). In [0, 1]; default 0.5. Lower it to keep more off-policy tokens. The mask
    modes of vllm_importance_sampling_mode read it; the truncate modes do not."""
    vllm_importance_sampling_clip_max: float = 5.0
    """C_max: tokens whose policy/sampler probability ratio rises above this are masked out of the loss (the truncate
    modes cap the ratio here instead). At least 1; default 5. Lower it if a few tokens with large ratios destabilise
    training. GRPO only: FlashREINFORCE refuses both."""
    vllm_importance_sampling_mode: str = "token_mask"
    """The off-policy correction, TRL's name: which tokens keep their importance weight, and how much of it.
    "token_mask" (default): a token whose ratio r leaves [C_min, C_max] is masked. "token_truncate": each token's
    weight is min(r, C_max). "sequence_mask" / "sequence_truncate": the same on a sample's whole-sequence ratio (the
    product of its tokens' r), for all its tokens. "geometric_mask": a sample is masked when the geometric mean of its
    tokens' r leaves [C_min, C_max]. sampling/masked_tokens_frac and sampling/masked_sequences_frac count what it
    masks. GRPO only."""
    importance_sampling_level: str = "token"
    """TRL's name. "token" (default): the trust region clips each token's ratio. "sequence": GSPO, every token of a
    sample carries the geometric mean of its tokens' ratios (GSPO's paper uses epsilon about 3e-4 and epsilon_high
    4e-4). "sequence" needs score_centering=False. GRPO only."""
    num_sampler_logprobs: int = 8
    """K: how many of the sampler's most likely tokens per position score centering averages over (vLLM returns at most
    20 unless started with a larger --max-logprobs). Default 8; raise it when sampling/sampler_mass, the probability
    they cover, is low. Not read with score_centering=False; refused under FlashREINFORCE."""
    token_budget: int | None = None
    """Tokens per packed row, one row per rank per micro-batch (a group's shared prompt counts once). None: the server's
    max_model_len. Longer samples are dropped (batch/dropped_oversize_count). Lower it if the trainer runs out of
    memory; raise it to pack more samples into each forward."""
    auto_find_batch_size: bool = False
    """transformers' out-of-memory retry: a step that runs out of device memory is packed again in rows of half its
    longest row's tokens and run again, and the steps after keep that token budget (one process only; a sample
    longer than half a row stops the run, saying so). False: the out-of-memory error stops the run."""
    tree_attention_kernel: str | None = None
    """"exact" (eager math, bitwise equal to `tandem serve --decode-mode exact`), "sdpa" or "flex" (GPU).
    None: flex on GPU, exact on CPU. tandem's own field, not in TRL's config."""

    # ---- the asynchronous pipeline ----
    max_concurrent_rollouts: int = 512
    """The most rollouts in flight at once; under it, the live cap follows the server's KV-cache usage. It also sizes
    the thread pool of synchronous tools and the embedded server's --max-num-seqs (at most 256). Lower it to what
    your tools and environments can run at once."""
    max_staleness: int = 4
    """Policy versions (weight syncs) a sample may lag the trainer: older ones are dropped (a group not yet trained is
    generated again), and generation runs about this many steps of tokens ahead. Default 4, as in TRL; 0: on-policy.
    Raise it when the trainer waits for samples (perf/rollout_wait_s); lower it when many tokens are masked."""
    in_flight_weight_updates: bool = False
    """NeMo-RL's name. False (default): a sample's lag is counted from the version its group started on. True: a group
    that runs across weight syncs is judged by its tokens, the mean version of the weights that sampled them, with
    max_staleness as the bound, and is never cancelled for a sync (sample/token_lag_* show the lag). tandem serve
    labels each token (it needs streamed weights: the embedded server has them); vLLM's tokens are then streamed and
    labelled by when they arrived. Full weights only, not LoRA."""
    recompute_kv_cache_after_weight_updates: bool = False
    """NeMo-RL's name. After each weight sync the server computes its running sequences' keys and values again, so
    each token comes from exactly one version's weights (sample/mixed_tokens_frac stays 0), at the cost of a prefill
    of every running sequence per sync. False: tandem serve keeps the cache the older weights computed. The embedded
    server gets the flag; an external tandem serve must be started with --recompute-kv-cache-after-weight-updates.
    vLLM always computes it again (its pause drops the running sequences' caches), whatever this says."""
    weight_sync_steps: int = 1
    """Optimizer steps between weight syncs to the server; each sync is one policy version, the unit of max_staleness.
    Raise it when syncing takes a large share of a step (tandem doctor says so), at the cost of staler samples."""
    weight_sync_check_atol: float | None = None
    """After each sync, score a fixed probe under the synced name and stop training if the server's log-probs differ
    from the trainer's forward by more than this at any token (1e-5 holds in fp32 with exact decoding). None: no such
    bound; against an external server the first syncs are probed all the same, until one is seen to reach it (mean gap
    within the dtype's rounding, log-probs moved toward the new weights). tandem's own field, not in TRL's config."""
    rollout_worker_timeout: float = 300.0
    """Seconds the rollout worker process may go without a heartbeat (its event loop beats twice a second) before the
    run stops, calling it hung. Raise it if reward functions or environments block that loop for longer."""
    reward_timeout: float | None = 600.0
    """Seconds one reward function may take on a group; a late or raising call is made once more, then the group is
    dropped (rollout/failed_count). None: no limit. tandem's own field."""
    stall_timeout: float | None = 3600.0
    """Seconds without a trainable sample before the run stops, saying why (groups dropped without reward variance
    and their rewards, stale and oversize drops, retried requests); it says so every minute before that. None: wait
    for ever (sparse rewards may legitimately take long). tandem's own field."""
    log_completions: bool = False
    """Log each window's completions with their prompt and reward: to completions.jsonl in output_dir, as a table to
    the report_to trackers, and on the console (num_completions_to_print). Off by default: it is verbose."""
    num_completions_to_print: int | None = None
    """How many of the logged completions the console prints at each log (None: all; 0: none); the file and the
    trackers get them all. Read only with log_completions."""

    # ---- evaluation ----
    eval_strategy: str = "no"
    """no | steps | epoch: generate the eval_dataset's prompts under the policy just synced, score them, log eval/*."""
    eval_steps: float | None = None
    """Evaluate every this many steps (below 1: a fraction of max_steps; None: logging_steps)."""
    eval_delay: float = 0
    """No evaluation is due before this optimizer step (counted in steps, also with eval_strategy 'epoch')."""
    eval_on_start: bool = False
    """Evaluate the starting policy before the first step."""

    # ---- transformers' TrainingArguments tandem does not implement: accepted at their defaults only (REFUSED) ----
    average_tokens_across_devices: bool = True
    """transformers: sum the loss's token count over ranks."""
    label_smoothing_factor: float = 0.0
    """transformers: label smoothing of the targets."""
    bf16_full_eval: bool = False
    """transformers: evaluate with the model cast to bf16."""
    fp16_full_eval: bool = False
    """transformers: evaluate with the model cast to fp16."""
    use_liger_kernel: bool = False
    """transformers: patch in Liger's fused Triton kernels."""
    liger_kernel_config: dict | None = None
    """transformers: which Liger kernels to apply."""
    use_cache: bool = False
    """transformers: let the model keep a KV cache."""
    neftune_noise_alpha: float | None = None
    """transformers: NEFTune noise on the embeddings."""
    per_device_eval_batch_size: int = 8
    """transformers: eval batch size per device."""
    prediction_loss_only: bool = False
    """transformers: evaluation returns the loss only."""
    eval_do_concat_batches: bool = True
    """transformers: concatenate eval outputs of batches."""
    eval_use_gather_object: bool = False
    """transformers: gather eval objects from all devices."""
    eval_accumulation_steps: int | None = None
    """transformers: eval steps before outputs go to CPU."""
    include_for_metrics: list[str] = field(default_factory=list)
    """transformers: extra inputs to compute_metrics."""
    batch_eval_metrics: bool = False
    """transformers: compute eval metrics batch by batch."""
    ignore_data_skip: bool = True
    """transformers: on resume, do not skip seen batches."""
    accelerator_config: dict | str | None = None
    """transformers: settings of its Accelerate backend."""
    parallelism_config: dict | None = None
    """transformers: Accelerate's parallelism layout."""
    dataloader_drop_last: bool = False
    """transformers: drop the last incomplete batch."""
    dataloader_num_workers: int = 0
    """transformers: DataLoader worker processes."""
    dataloader_pin_memory: bool = True
    """transformers: pin the DataLoader's memory."""
    dataloader_persistent_workers: bool = False
    """transformers: keep DataLoader workers alive."""
    dataloader_prefetch_factor: int | None = None
    """transformers: batches each worker preloads."""
    dataloader_multiprocessing_context: str | None = None
    """transformers: DataLoader workers' start method."""
    dataloader_in_order: bool = True
    """transformers: yield batches in dispatch order."""
    label_names: list[str] | None = None
    """transformers: the input keys that hold labels."""
    length_column_name: str = "length"
    """transformers: column of precomputed lengths."""
    ddp_find_unused_parameters: bool | None = None
    """transformers: DDP's find_unused_parameters."""
    ddp_bucket_cap_mb: int | None = None
    """transformers: DDP's gradient bucket size, in MB."""
    ddp_broadcast_buffers: bool | None = None
    """transformers: DDP's broadcast_buffers."""
    ddp_static_graph: bool | None = None
    """transformers: DDP's static_graph."""
    ddp_backend: str | None = None
    """transformers: torch.distributed's backend."""
    fsdp: str | None = None
    """transformers: turn on its FSDP integration."""
    deepspeed: dict | str | None = None
    """transformers: a DeepSpeed config (file or dict)."""
    do_train: bool = False
    """transformers: tells its example scripts to train."""
    do_eval: bool = False
    """transformers: tells its example scripts to evaluate."""
    do_predict: bool = False
    """transformers: tells its example scripts to predict."""
    local_rank: int = -1
    """transformers: this process's rank on its machine."""

    def __post_init__(self):
        validate(self)  # every check, then the values that follow from others (config_checks.py)

    def every(self, name: str) -> int:
        """`logging_steps`, `save_steps` or `eval_steps` in whole steps: below 1 it is a fraction of max_steps,
        rounded up, as transformers takes it (eval_steps None: logging_steps)."""
        value = getattr(self, name)
        if value is None:
            return self.every("logging_steps")
        return math.ceil(self.max_steps * value) if value < 1 else int(value)

    @property
    def debug_options(self) -> list[str]:
        """`debug` as a list: transformers takes a space-separated string or a list."""
        return self.debug.split() if isinstance(self.debug, str) else list(self.debug)

    @property
    def staleness_policy(self) -> StalenessPolicy:
        """Every rule `max_staleness` decides (tandem/contract/staleness.py)."""
        return StalenessPolicy(self.max_staleness, self.in_flight_weight_updates)

    @property
    def uses_truncated_sampling(self) -> bool:
        return self.top_k > 0 or self.top_p < 1 or self.min_p is not None

    def changed(self) -> dict[str, Any]:
        """The fields not at their defaults, as `to_dict` shows them (what a dry run prints)."""
        defaults, values = dataclasses.asdict(AsyncGRPOConfig()), dataclasses.asdict(self)
        return {name: value for name, value in self.to_dict().items() if values[name] != defaults[name]}

    def to_dict(self) -> dict[str, Any]:
        """Every field, the API key masked (this is what logs, sinks and dry runs show)."""
        values = dataclasses.asdict(self)
        for secret in ("vllm_server_api_key", "hub_token"):
            if values[secret]:
                values[secret] = "***"
        return values


def mapping(value: dict | str | None) -> dict | None:
    """A field that takes a mapping or its JSON text, as transformers' do (`fsdp_config`, `chat_template_kwargs`,
    ...), read after the config's checks: a mapping by then (`config_checks.normalise` parses the text), or None."""
    assert not isinstance(value, str), "AsyncGRPOConfig parses a JSON field's text into a mapping"
    return value
