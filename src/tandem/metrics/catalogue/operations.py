"""The metric catalogue's entries on how the run holds up: weight syncs, recovery from failures, tools and environments,
memory, progress and evaluation."""

from tandem.metrics.catalogue.metric import Metric

OPERATIONS = (
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
        "Passes over the training dataset so far: finished prompt indices over the dataset's length "
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
