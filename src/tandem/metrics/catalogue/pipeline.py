"""The metric catalogue's entries on how the data moves: batches and packing, samples and their staleness, the rollout
queue, the generation server's load, throughput and timing."""

from tandem.metrics.catalogue.metric import Metric

PIPELINE = (
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
        "sample/token_lag_mean",
        "Policy versions between the weights being trained and those that sampled each trained token, averaged over "
        "trained tokens. A sync in the middle of a generation makes its later tokens newer than the version its group "
        "started on (sample/staleness_*, which counts from that start).",
        "Below sample/staleness_mean by the share of tokens generated after a sync. Under in_flight_weight_updates "
        "each group's mean is at most max_staleness.",
    ),
    Metric(
        "sample/mixed_tokens_frac",
        "Share of a trained sample's tokens sampled after a weight sync in the middle of their turn, averaged over "
        "trained samples: the server kept the key-value cache the older weights computed, so they come from neither "
        "version exactly (the importance ratio still uses the sampler's own log-probs). 0 to 1.",
        "Grows with long generations and frequent syncs.",
    ),
    Metric(
        "sample/token_lag_max",
        "The largest lag, in policy versions, of any trained token in the window (see sample/token_lag_mean).",
    ),
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
)
