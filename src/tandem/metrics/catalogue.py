"""Every metric name a run logs to `metrics.jsonl` (and to tensorboard / wandb / trackio), with what it measures and
how to read it. Names built at run time are patterns: `{source}` or `{tool}` stands for one path segment."""

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    name: str
    """The logged name, or a pattern whose `{placeholder}` stands for one path segment (a reward function's name)."""
    meaning: str
    """What it measures, with its unit."""
    reading: str = ""
    """How to read it: what a healthy value looks like, and what a bad one points to."""


METRICS = (
    # ---- reward ---------------------------------------------------------------------------------------------------
    Metric(
        "reward",
        "Mean total reward (the sum over every reward source) of the rollouts scored in the logging window, whether "
        "their group was trained or dropped; rollouts no source scored are left out. In reward units.",
        "Should rise over the run. Flat at the bottom with frac_reward_zero_std near 1: the model never succeeds "
        "(task too hard, or the reward function does not parse its answers); flat at the top: nothing left to learn.",
    ),
    Metric(
        "reward_kept",
        "Mean total reward of the samples the trainer trained on in the window (each trained sample counts once; "
        "a multi-turn rollout split into several samples counts once per sample). In reward units.",
        "Usually close to `reward`; far above or below it means the groups that carry a learning signal are not "
        "typical of what is generated.",
    ),
    Metric(
        "reward_dropped",
        "Mean reward of the rollouts in groups dropped because their rewards did not differ (so they carry no "
        "learning signal). Logged only when a group was dropped. In reward units.",
        "Tells why groups are dropped: near the top of the reward scale, the prompts are too easy; near the bottom, "
        "too hard or the reward function fails to recognise correct answers.",
    ),
    Metric(
        "reward_group_std",
        "Standard deviation of the total reward within a group (population std over the group's scored rollouts), "
        "averaged over the samples trained in the window. In reward units.",
        "The spread the advantages are normalised by; near 0 means the trained groups barely differ inside.",
    ),
    Metric(
        "frac_reward_zero_std",
        "Fraction of the groups scored in the window that were dropped for lack of signal: fewer than two scored "
        "rollouts, or all rewards equal (GRPO). With FlashREINFORCE, the fraction of groups that no reward source "
        "scored at all. 0 to 1.",
        "Below about 0.5 is healthy. Near 1 the trainer waits for rare useful groups: see reward_dropped for "
        "whether they are all right or all wrong.",
    ),
    Metric(
        "rewards/{source}/mean",
        "Mean value one reward source gave the rollouts it scored in the window. A source is a reward function "
        "(by its __name__), an environment class with get_reward() (by its class name), a verifiers environment's "
        "reward, or the rollout's own reward (`rollout_reward`, or `harness_reward` for OpenEnv episodes). In that "
        "source's units.",
        "With several reward functions, shows which one moves; one stuck at 0 often parses nothing.",
    ),
    Metric(
        "rewards/{source}/group_std",
        "Standard deviation of one reward source's values within a group, averaged over the samples trained in the "
        "window. In that source's units.",
        "A source whose group std stays at 0 contributes nothing to the advantages.",
    ),
    # ---- completions ----------------------------------------------------------------------------------------------
    Metric(
        "completions/mean_length",
        "Mean length of the completions generated in the window, in tokens (every model-generated token of the "
        "rollout, over all its turns; tool results not counted).",
        "A steady climb to max_completion_length, with completions/clipped_ratio rising, means answers get cut off.",
    ),
    Metric("completions/min_length", "Shortest completion generated in the window, in tokens."),
    Metric("completions/max_length", "Longest completion generated in the window, in tokens."),
    Metric(
        "completions/mean_terminated_length",
        "Mean length of the completions that ended with an end-of-sequence token, in tokens. Logged only when one did.",
        "The length of finished answers, without the truncated ones pulling the mean up.",
    ),
    Metric(
        "completions/min_terminated_length", "Shortest completion that ended with an end-of-sequence token, in tokens."
    ),
    Metric(
        "completions/max_terminated_length", "Longest completion that ended with an end-of-sequence token, in tokens."
    ),
    Metric(
        "completions/clipped_ratio",
        "Fraction of the completions generated in the window that did not end with an end-of-sequence token "
        "(cut off at max_completion_length or by the server's context). 0 to 1.",
        "Near 0 is healthy. A high value with rewards stuck at the bottom: raise max_completion_length.",
    ),
    Metric(
        "completions/duplicate_frac",
        "Fraction of completions that repeat, token for token, an earlier completion of the same group. 0 to "
        "(G-1)/G for G generations per prompt.",
        "Rising together with a falling entropy is the sign of collapse: every rollout says the same thing.",
    ),
    # ---- loss and policy ------------------------------------------------------------------------------------------
    Metric(
        "loss",
        "The training objective's value, summed over the step's rows (each row normalised by the trained tokens of "
        "its micro-batch, averaged over micro-batches), averaged over the window's steps; steps whose loss was NaN "
        "or infinite are left out (with logging_nan_inf_filter=False the window logs that value instead). Unitless.",
        "Not a progress measure: the advantages are centred, so it hovers near 0 whether or not the run learns. "
        "Under FlashREINFORCE it is a surrogate with the right gradient, not the reference loss's value.",
    ),
    Metric(
        "grad_norm",
        "Total norm of the gradients before clipping to max_grad_norm, averaged over the window's steps.",
        "Spikes (orders of magnitude above its usual level) precede instability: lower learning_rate.",
    ),
    Metric(
        "learning_rate",
        "The learning rate the scheduler holds after the step (the one the next step uses), averaged over the "
        "window's steps.",
    ),
    Metric(
        "entropy",
        "Mean entropy of the trainer's next-token distribution (at the sampling temperature, renormalised over the "
        "sampler's kept tokens when top-k / top-p apply) at every trained token, in nats.",
        "Falls slowly as the policy sharpens; a fall to near 0 within a few windows, with duplicates rising, is "
        "collapse.",
    ),
    Metric(
        "aux_loss",
        "A Mixture-of-Experts model's router load-balancing loss, per row before it is weighted by "
        "router_aux_loss_coef, averaged over the window's rows. Logged only for models with a router, when the "
        "coefficient is not 0 (GRPO and FlashREINFORCE alike).",
        "Rising means the experts' load grows unbalanced.",
    ),
    Metric(
        "clip_ratio/low_mean",
        "Fraction of trained tokens whose importance ratio (trainer over sampler probability) is below 1 - epsilon, "
        "whatever the sign of their advantage. 0 to 1 (always 0 under FlashREINFORCE).",
        "Near 0 is healthy; a large value means the policy moved far from the sampler (staleness, a high learning "
        "rate).",
    ),
    Metric(
        "clip_ratio/high_mean",
        "Fraction of trained tokens whose importance ratio is above 1 + epsilon_high (epsilon when unset), whatever "
        "the sign of their advantage. 0 to 1.",
        "Near 0 is healthy; see clip_ratio/low_mean.",
    ),
    Metric(
        "clip_ratio/region_mean",
        "Fraction of trained tokens whose importance ratio lies outside [1 - epsilon, 1 + epsilon_high]: the sum of "
        "clip_ratio/low_mean and clip_ratio/high_mean. 0 to 1.",
    ),
    Metric(
        "clip_ratio/low_min",
        "The lowest, over the window's samples, of a sample's fraction of trained tokens with a ratio below "
        "1 - epsilon (taken row by row, then the minimum). 0 to 1.",
    ),
    Metric(
        "clip_ratio/high_max",
        "The highest, over the window's samples, of a sample's fraction of trained tokens with a ratio above "
        "1 + epsilon_high. 0 to 1.",
        "A value near 1 points at single samples the policy has moved far away from.",
    ),
    # ---- importance sampling --------------------------------------------------------------------------------------
    Metric(
        "sampling/importance_sampling_ratio/mean",
        "Mean, over trained tokens, of the importance ratio: the trainer's probability of the sampled token over "
        "the probability the generation server sampled it with. It covers both the server/trainer mismatch and "
        "staleness.",
        "Close to 1.0 is healthy (drift beyond about 5%: lower max_staleness or sync more often); outside "
        "[vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max] the run is not valid.",
    ),
    Metric("sampling/importance_sampling_ratio/min", "Smallest importance ratio of any trained token in the window."),
    Metric(
        "sampling/importance_sampling_ratio/max",
        "Largest importance ratio of any trained token in the window.",
        "Very large values point at tokens the server sampled at a probability the trainer finds far likelier.",
    ),
    Metric(
        "sampling/sampling_logp_difference/mean",
        "Mean absolute difference between the trainer's and the server's log-probability of each trained token, in "
        "nats.",
        "On samples of staleness 0 it should stay at rounding level (about 1e-3 in float32, 0.25 in bfloat16); "
        "above that the server samples from other weights or another log-prob mode.",
    ),
    Metric(
        "sampling/sampling_logp_difference/max",
        "Largest absolute difference between the trainer's and the server's log-probability of any trained token in "
        "the window, in nats.",
    ),
    Metric(
        "sampling/masked_mean",
        "Fraction of trained tokens left out of the loss because their importance ratio fell outside "
        "[vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max] (masked importance sampling). 0 to 1.",
        "Near 0 is healthy; a growing share means the sampler and the trainer disagree (staleness, a dtype or "
        "log-prob mode mismatch).",
    ),
    Metric(
        "sampling/sampler_mass",
        "Score centering only: the probability mass the server's top num_sampler_logprobs tokens hold at each "
        "trained position, averaged over trained tokens. 0 to 1.",
        "Close to 1 means the centring term sees almost the whole distribution; low values (high entropy) make it "
        "approximate: raise num_sampler_logprobs.",
    ),
    # ---- FlashREINFORCE -------------------------------------------------------------------------------------------
    Metric(
        "flash/acceptance_rate",
        "FlashREINFORCE: fraction of the step's trajectories admitted by the sequence trust region (their mean "
        "per-token KL between sampler and policy at most flash_delta); averaged over the window's steps. 0 to 1.",
        "Near 1 is healthy; a low rate means most trajectories are too far off-policy to train: lower "
        "max_staleness or the learning rate, or raise flash_delta.",
    ),
    Metric(
        "flash/sequence_kl_mean",
        "FlashREINFORCE: mean over trajectories of each trajectory's mean per-token Bernoulli KL divergence between "
        "the sampler's and the policy's probability of its own tokens, in nats.",
        "Compare with flash_delta: trajectories above it are rejected.",
    ),
    Metric(
        "flash/sequence_kl_max",
        "FlashREINFORCE: the largest per-trajectory mean KL of a step (see flash/sequence_kl_mean), the largest "
        "over the window, in nats.",
    ),
    Metric(
        "flash/retained_tokens_frac",
        "FlashREINFORCE: fraction of the step's policy tokens that take part in the update (in admitted "
        "trajectories, and among the highest-entropy tokens of failed ones when flash_negative_token_fraction < 1). "
        "0 to 1.",
    ),
    # ---- batches and packing ---------------------------------------------------------------------------------------
    Metric(
        "batch/samples_per_step",
        "Samples trained per optimizer step (mean over the window's steps).",
        "Compared with rollout/queue_size: a queue shorter than one step's samples means the trainer waits.",
    ),
    Metric("batch/groups_per_step", "Distinct groups (prompts) whose samples a step trained (mean over steps)."),
    Metric(
        "batch/microbatches_per_step",
        "Micro-batches (forward/backward rounds) in a step (mean over steps).",
        "Many micro-batches of about one sample each are slow: set token_budget to pack samples into rows.",
    ),
    Metric(
        "batch/forwarded_tokens_per_step",
        "Tokens forwarded through the model in a step: the packed rows' tokens, a prefix shared by a group's "
        "samples counted once (mean over steps).",
    ),
    Metric(
        "batch/trained_tokens_per_step",
        "Tokens the loss is computed on in a step: the generated tokens of its samples (mean over steps).",
    ),
    Metric(
        "batch/masked_token_frac",
        "Fraction of a step's forwarded positions whose next token is not trained (prompt and tool-result "
        "positions), so their output is not used by the loss. 0 to 1.",
    ),
    Metric("batch/samples_per_row", "Samples packed into one row (one forward pass), averaged over rows."),
    Metric("batch/row_tokens_mean", "Tokens in a packed row (after prefix sharing), averaged over rows."),
    Metric("batch/row_tokens_max", "Tokens in the longest packed row of the window."),
    Metric(
        "batch/row_fill_frac",
        "A packed row's tokens over token_budget, averaged over rows. 0 to 1.",
        "Well below 1 means rows close early; a larger share fits when samples are shorter than the budget.",
    ),
    Metric(
        "batch/packing_ratio",
        "A row's tokens before packing (each sample's full length) over the tokens it forwards, averaged over rows.",
        "Above 1 is the saving of sharing each group's prompt; below 1, in padded rows, is what the padding costs.",
    ),
    Metric(
        "batch/row_imbalance",
        "Under torchrun (one row per rank): the costliest row's attention load over the ranks' mean load (1.0 is "
        "even; always 1.0 on one process).",
        "Well above 1 means ranks wait for the slowest one.",
    ),
    Metric(
        "batch/pad_frac",
        "Under torchrun: the share of the ranks' token slots that padding every row to the longest would add, i.e. "
        "how long ranks idle. 0 to 1 (always 0 on one process).",
    ),
    Metric(
        "batch/dropped_oversize_count",
        "Samples dropped because they are longer than token_budget (or, under FlashREINFORCE, belong to a rollout "
        "that fits no micro-batch), summed over the window.",
        "Should be 0: raise token_budget, or shorten completions.",
    ),
    # ---- samples and staleness ------------------------------------------------------------------------------------
    Metric(
        "sample/staleness_mean",
        "How many policy versions old the trained samples were: the trainer's version minus the version the server "
        "sampled them from, averaged over trained samples.",
        "Bounded by max_staleness; 0 is fully on-policy. A mean near max_staleness means the queue runs ahead.",
    ),
    Metric("sample/staleness_max", "Largest staleness (policy versions) of a sample trained in the window."),
    Metric(
        "sample/time_in_queue_s",
        "Seconds from a sample's scoring in the rollout worker to its placement in a training row, averaged over "
        "samples.",
    ),
    Metric(
        "sample/forwarded_tokens_mean",
        "Length of a trained sample (prompt plus completion), in tokens, averaged over trained samples.",
    ),
    Metric("sample/forwarded_tokens_max", "Length of the longest sample trained in the window, in tokens."),
    Metric("sample/trained_tokens_mean", "Generated (trained) tokens of a sample, averaged over trained samples."),
    Metric(
        "sample/dropped_stale_count",
        "Samples dropped because they were more than max_staleness versions old when their turn came, summed over "
        "the window (a group none of whose samples was trained yet is generated again).",
        "A few are normal; as many as are trained means max_staleness is too tight.",
    ),
    # ---- rollout and queue ----------------------------------------------------------------------------------------
    Metric(
        "rollout/queue_size",
        "Samples waiting in the trainer's queue when a step starts taking its rows, averaged over steps.",
        "About a step's worth (batch/samples_per_step) or more keeps the trainer busy; near 0 with a high "
        "perf/rollout_wait_s means generation is the bottleneck.",
    ),
    Metric("rollout/completions_count", "Completions generated and scored in the window, trained or not (summed)."),
    Metric(
        "rollout/concurrency",
        "Rollouts being generated at once, sampled every second in the rollout worker (mean of the samples).",
        "Pinned at rollout/concurrency_cap with generation the bottleneck: the cap binds.",
    ),
    Metric(
        "rollout/concurrency_cap",
        "The live limit on rollouts in flight, driven by the server's KV-cache usage (at most "
        "max_concurrent_rollouts), sampled every second (mean).",
    ),
    Metric(
        "rollout/backpressure_s",
        "Seconds a group waited before starting for room in the token allowance (queued plus in-flight tokens kept "
        "within max_staleness steps' worth), averaged over groups.",
        "High while the trainer also waits (perf/rollout_wait_s): max_staleness is too tight. High alone: the "
        "trainer is the bottleneck.",
    ),
    Metric(
        "rollout/allowance_used_max",
        "The largest share of the token allowance in use (queued plus in-flight tokens, with the starting group's "
        "reservation, over the allowance) when a group started in the window. 0 to about 1.",
        "At 0.95 or more, generation is held back by the staleness bound.",
    ),
    Metric(
        "rollout/duration_s",
        "Seconds one rollout spent generating (all its turns and tool calls; a single-turn group's one request "
        "counts for each of its rollouts), averaged over rollouts; evaluation rollouts included.",
    ),
    Metric(
        "rollout/generated_tokens_per_s",
        "Tokens the server generated for the rollout worker per second of wall-clock time (evaluation included).",
        "The generation throughput; compare with perf/wall_clock_trained_tokens_per_s.",
    ),
    Metric(
        "rollout/score_queue_size",
        "Generated groups waiting to be scored, sampled every second (mean).",
        "Growing towards its limit of 16 means the reward functions are the bottleneck.",
    ),
    Metric("rollout/score_wait_s", "Seconds a generated group waited in the scoring queue, averaged over groups."),
    Metric(
        "rollout/score_block_s",
        "Seconds a generated group waited to enter the full scoring queue, averaged over groups.",
        "Above 0 means scoring cannot keep up with generation: make reward functions faster (async).",
    ),
    Metric(
        "rollout/score_s",
        "Seconds spent scoring a group (every reward function and the advantages), averaged over groups.",
    ),
    Metric(
        "rollout/samples_per_rollout",
        "Training samples a rollout became (1, or more when a multi-turn rollout's re-rendered history forked), "
        "averaged over rollouts.",
    ),
    Metric("rollout/turns_mean", "Sampling requests (model turns) per rollout, averaged over rollouts."),
    Metric("rollout/turns_max", "Most sampling requests (model turns) of any rollout in the window."),
    Metric(
        "rollout/fork_frac",
        "Of the turn-to-turn transitions of multi-turn rollouts, the fraction where the next prompt did not extend "
        "the tokens held so far (the chat template re-rendered the history), starting a new training sample. 0 to 1.",
        "Near 0 is best; a high value means the chat template rewrites earlier turns (each fork re-forwards the "
        "history).",
    ),
    Metric(
        "rollout/drift_tokens_mean",
        "At each turn-to-turn transition, how many of the tokens held so far the next prompt does not reproduce "
        "(0 when it extends them), averaged over transitions, in tokens.",
    ),
    Metric("rollout/drift_tokens_max", "The largest such drift of a transition in the window, in tokens."),
    Metric(
        "rollout/context_exhausted_count",
        "Rollouts whose conversation ended because its next prompt would leave no room in the server's context "
        "length (max_model_len), summed.",
    ),
    Metric(
        "rollout/failed_count",
        "Groups dropped because a reward function or the server failed on them twice, summed.",
        "Should be 0; the run stops after 5 in a row for one cause. The lines 'tandem: dropped the group ...' say why.",
    ),
    Metric(
        "rollout/cancelled_stale_count",
        "Groups cancelled mid-generation because their policy version fell more than max_staleness behind (their "
        "prompt is generated again), summed.",
    ),
    Metric(
        "rollout/stale_adapter_count",
        "LoRA runs: groups generated again because the server had already unloaded the adapter version they "
        "sampled from, summed.",
    ),
    # ---- server and KV cache --------------------------------------------------------------------------------------
    Metric(
        "rollout/vllm_kv_cache_usage_frac",
        "Fraction of the generation server's KV cache in use (the fullest engine's), read from its /metrics every "
        "5 seconds. 0 to 1.",
        "Above 0.8 at a poll the concurrency cap is lowered by 30%; near 1 with requests waiting, the server is "
        "saturated.",
    ),
    Metric("rollout/vllm_running_requests", "Requests the generation server is running, read every 5 seconds (mean)."),
    Metric(
        "rollout/vllm_queued_requests",
        "Requests waiting in the generation server, read every 5 seconds (mean).",
        "A backlog in most polls, a quarter of the running ones or more, means the server is at capacity.",
    ),
    Metric(
        "rollout/vllm_preemption_count",
        "Requests the generation server preempted (evicted from its KV cache) since the previous poll, summed.",
        "Above 0 means the KV cache is too small for the concurrency.",
    ),
    Metric(
        "rollout/vllm_retry_count",
        "Requests to the generation server retried after a transport error or a 502/503/504 answer, summed.",
        "Should be 0; a growing count means the server is overloaded or restarting.",
    ),
    # ---- throughput and timing ------------------------------------------------------------------------------------
    Metric(
        "perf/step_s",
        "Wall-clock seconds of an optimizer step: waiting for samples, forward and backward, optimizer, and the "
        "weight sync (what the step waited for of it); an evaluation is left out (mean over the window's steps).",
        "Compared with perf/fwd_bwd_s: close means compute-bound; much larger means waits dominate.",
    ),
    Metric(
        "perf/rollout_wait_s",
        "Seconds a step waited for the rollout worker to deliver trainable samples (mean over steps).",
        "Near 0 is healthy; 30% of the step or more means generation is the bottleneck.",
    ),
    Metric("perf/fwd_s", "Seconds of a step's forward passes with gradients (mean over steps)."),
    Metric(
        "perf/fwd_bwd_s",
        "Seconds of a step's forward and backward passes (FlashREINFORCE's gradient-free scoring pass included; "
        "mean over steps).",
        "The backward is this less perf/fwd_s; about twice the forward is usual, 2.8 times or more means it "
        "recomputes the forward (gradient_checkpointing).",
    ),
    Metric("perf/optimizer_s", "Seconds of a step's gradient clipping, optimizer step and scheduler step (mean)."),
    Metric(
        "perf/fwd_bwd_forwarded_tokens_per_s",
        "Forwarded tokens (shared prefixes once) per second of forward and backward: total tokens over total "
        "seconds of the window.",
    ),
    Metric(
        "perf/fwd_bwd_trained_tokens_per_s",
        "Trained tokens per second of forward and backward: total over total seconds of the window.",
    ),
    Metric(
        "perf/wall_clock_forwarded_tokens_per_s",
        "Forwarded tokens (shared prefixes once) per second of whole steps (perf/step_s): total over total seconds.",
    ),
    Metric(
        "perf/wall_clock_trained_tokens_per_s",
        "Trained tokens per second of whole steps: total over total seconds of the window.",
        "The run's end-to-end training throughput.",
    ),
    Metric(
        "perf/fwd_bwd_mfu",
        "Model FLOPs utilisation of forward and backward: the FLOPs the step's rows need over what the step's GPUs "
        "could do at peak in perf/fwd_bwd_s. 0 to 1; only on GPUs of known peak, never on CPU.",
    ),
    Metric(
        "perf/wall_clock_mfu",
        "Model FLOPs utilisation over the whole step (perf/step_s). 0 to 1; only on GPUs of known peak.",
    ),
    # ---- weight sync ----------------------------------------------------------------------------------------------
    Metric(
        "perf/weight_sync_s",
        "Seconds a weight sync took from its start until the server serves the new weights (mean over syncs).",
        "Divided by weight_sync_steps, 20% of perf/step_s or more is worth a knob: raise weight_sync_steps, or "
        "stream weights (--weight-transfer-config).",
    ),
    Metric(
        "perf/weight_sync_transfer_s",
        "Seconds of a sync spent moving weights and bringing the server back: writing and reloading a checkpoint "
        "folder or streaming the tensors, then resuming generation; or loading a LoRA adapter (mean over syncs).",
    ),
    Metric(
        "perf/weight_sync_pause_s",
        "Seconds the server took to answer the request to pause generation before new weights are loaded (mean "
        "over syncs; 0 when it swaps weights without pausing). Not logged by LoRA syncs, which do not pause.",
    ),
    Metric(
        "perf/weight_sync_wait_s",
        "Seconds the training loop waited for a sync to finish: the whole sync, or only what an overlapped sync "
        "outlasted the next step's forward and backward by (mean over syncs).",
        "What syncs really cost a step.",
    ),
    Metric(
        "perf/weight_sync_barrier_s",
        "Under torchrun: seconds ranks waited at the barrier before a sync for the slowest rank to finish its step "
        "(mean over syncs). Never logged by one process.",
    ),
    Metric(
        "weight_sync/served_logprob_gap",
        "After a checked sync: the largest absolute difference, over a fixed probe's tokens, between the server's "
        "log-probabilities under the new version and the trainer's own, in nats. Logged only for probed syncs "
        "(weight_sync_check_atol set, or the first syncs to an external server).",
        "At rounding level (about 1e-5 in float32, up to about 0.35 in bfloat16) the server serves the trainer's "
        "weights.",
    ),
    # ---- recovery -------------------------------------------------------------------------------------------------
    Metric(
        "rollout/server_restart_count",
        "Times the embedded generation server died and was restarted with the current weights, summed.",
        "After three restarts within ten minutes, the next death stops the run.",
    ),
    Metric("perf/server_restart_s", "Seconds a restart of the embedded generation server took (mean over restarts)."),
    Metric(
        "rollout/server_reconnect_count",
        "Times a weight sync failed because an external server went away and was synced again once it answered, "
        "summed.",
    ),
    Metric(
        "rollout/worker_restart_count",
        "Times the rollout worker was lost (killed, or silent past rollout_worker_timeout) and started again, summed.",
        "At most 1: a second loss stops the run.",
    ),
    Metric(
        "stalled_s",
        "Seconds the trainer has waited without a trainable sample; only on the extra lines written about once a "
        "minute while such a wait lasts (they carry the worker's metrics under the last step).",
        "The lines 'tandem: no trainable sample ...' beside it say why; past stall_timeout the run stops.",
    ),
    # ---- tools and environments -----------------------------------------------------------------------------------
    Metric(
        "tools/call_frequency",
        "Tool calls per rollout, averaged over the rollouts of runs with tools or environments.",
        "0 throughout means the model never calls its tools (check the chat template and tool_call_parser).",
    ),
    Metric(
        "tools/failure_frequency",
        "Fraction of tool calls that failed: an error, a timeout, an unknown tool name or a call that could not be "
        "parsed. 0 to 1; NaN in a window without a call (runs with tools or environments only).",
        "Falling over the run is the model learning to call tools correctly.",
    ),
    Metric("tools/latency_s", "Seconds a tool call took (calls of a tool that exists), averaged over calls."),
    Metric(
        "tools/loop_exhausted_frac",
        "Fraction of rollouts with tools that ended because they reached max_tool_calling_iterations with calls "
        "still pending. 0 to 1.",
    ),
    Metric(
        "tools/parallel_calls_mean", "Tool calls in a model reply whose calls were run, averaged over such replies."
    ),
    Metric(
        "tools/unknown_name_count",
        "Tool calls naming a tool the rollout does not have, summed.",
        "A policy error: high early on, it should fall as the model learns the tools' names.",
    ),
    Metric("tools/{tool}/call_count", "Calls of one tool (by its function name), summed."),
    Metric("tools/{tool}/failure_count", "Calls of one tool that raised, got bad arguments or timed out, summed."),
    Metric(
        "tools/{tool}/latency_s",
        "Seconds a call of one tool took, averaged over its calls.",
        "Close to tool_call_timeout means calls are being cut off.",
    ),
    Metric(
        "env/reset_s",
        "Seconds an environment took to start an episode (reset(), or an integration's setup), averaged over episodes.",
    ),
    Metric(
        "env/reward_s",
        "Seconds an environment took to score an episode (get_reward(), or an integration's scoring), averaged over "
        "episodes.",
    ),
    Metric(
        "env/failure_count",
        "OpenEnv or verifiers episodes that raised and were left out of their group, summed.",
        "20 in a row stop the run with the last error.",
    ),
    # ---- memory ---------------------------------------------------------------------------------------------------
    Metric(
        "memory/host_rss_max_gib",
        "Resident host memory of the training process (on Linux the current figure, elsewhere the peak), the "
        "largest reading of the window over every rank, in GiB. Only with skip_memory_metrics=False.",
    ),
    Metric(
        "memory/cuda_max_allocated_gib",
        "Peak GPU memory allocated by tensors during a step, the largest of the window over every rank, in GiB. "
        "Only on a GPU with skip_memory_metrics=False.",
    ),
    # ---- run progress ---------------------------------------------------------------------------------------------
    Metric(
        "num_tokens",
        "Tokens forwarded through the model since the run started (packed rows, shared prefixes once), a running "
        "total.",
    ),
    Metric(
        "num_input_tokens_seen",
        "transformers' count of the tokens the trainer forwarded since the run started, logged with "
        "include_num_input_tokens_seen: 'all' counts a padded row's padding (then it equals num_tokens), "
        "'non_padding' does not.",
    ),
    Metric(
        "model_version",
        "The trainer's policy version when the line was written: it goes up by one with each weight sync.",
    ),
    Metric(
        "epoch",
        "Passes over the training dataset so far: finished prompt positions over the dataset's length "
        "(fractional). Only for datasets with a length.",
    ),
    # ---- evaluation -----------------------------------------------------------------------------------------------
    # Each evaluation generates every eval_dataset prompt under the policy the server serves, scores it and records
    # the per-group metrics above under eval/; nothing is trained.
    Metric(
        "eval/reward",
        "Mean total reward of the evaluation completions, in reward units.",
        "The held-out counterpart of `reward`; callbacks also see it as eval_reward (metric_for_best_model).",
    ),
    Metric(
        "eval/reward_dropped",
        "Mean reward of the evaluation groups whose rewards did not differ (logged only when there are some).",
    ),
    Metric(
        "eval/frac_reward_zero_std",
        "Fraction of evaluation groups whose rewards did not differ (or had fewer than two scored rollouts). 0 to 1.",
    ),
    Metric("eval/rewards/{source}/mean", "Mean value one reward source gave the evaluation completions it scored."),
    Metric("eval/rollout/completions_count", "Completions generated and scored by the evaluation."),
    Metric("eval/completions/mean_length", "Mean length of the evaluation completions, in tokens."),
    Metric("eval/completions/min_length", "Shortest evaluation completion, in tokens."),
    Metric("eval/completions/max_length", "Longest evaluation completion, in tokens."),
    Metric(
        "eval/completions/mean_terminated_length",
        "Mean length of the evaluation completions that ended with an end-of-sequence token, in tokens.",
    ),
    Metric(
        "eval/completions/min_terminated_length",
        "Shortest evaluation completion that ended with an end-of-sequence token, in tokens.",
    ),
    Metric(
        "eval/completions/max_terminated_length",
        "Longest evaluation completion that ended with an end-of-sequence token, in tokens.",
    ),
    Metric(
        "eval/completions/clipped_ratio",
        "Fraction of evaluation completions that did not end with an end-of-sequence token. 0 to 1.",
    ),
    Metric(
        "eval/completions/duplicate_frac",
        "Fraction of evaluation completions repeating an earlier one of the same prompt. 0 to 1.",
    ),
    Metric(
        "eval/failed_count",
        "Evaluation prompts whose group failed (the server or a reward function, twice) and were left out.",
        "Should be 0; each failure is said on the console with its row.",
    ),
    Metric("eval/runtime_s", "Seconds the evaluation took, from asking for it to its metrics."),
    Metric("eval/model_version", "The policy version that was evaluated."),
    Metric("eval/num_prompts", "Prompts in the evaluation dataset."),
)


def _pattern(name: str) -> re.Pattern:
    """A catalogue name as a regular expression: each `{placeholder}` matches one path segment."""
    return re.compile("[^/]+".join(re.escape(part) for part in re.split(r"\{[^{}/]+\}", name)) + r"\Z")


_EXACT = {metric.name: metric for metric in METRICS if "{" not in metric.name}
_PATTERNS = [(_pattern(metric.name), metric) for metric in METRICS if "{" in metric.name]


def find(name: str) -> Metric | None:
    """The catalogue entry of a logged name (`rewards/accuracy_reward/mean` finds `rewards/{source}/mean`), or None."""
    if name in _EXACT:
        return _EXACT[name]
    return next((metric for pattern, metric in _PATTERNS if pattern.match(name)), None)
