"""The metric catalogue's entries on what the run learns: rewards, completions, the loss and the policy's movement,
importance sampling and FlashREINFORCE's own quantities."""

from tandem.metrics.catalogue.metric import Metric

LEARNING = (
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
        "Fraction of trained tokens whose importance ratio falls outside "
        "[vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max], whatever the correction: the share "
        "the default token_mask leaves out of the loss. 0 to 1.",
        "Near 0 is healthy; a growing share means the sampler and the trainer disagree (staleness, a dtype or "
        "log-prob mode mismatch).",
    ),
    Metric(
        "sampling/effective_sample_size",
        "The normalised effective sample size of the trained tokens' importance ratios, (Σr)² / (N·Σr²), pooled over "
        "the window's tokens. 1 when the sampler and the trainer agree on every token; 1/N when one token carries "
        "all the weight.",
        "A fall below about 0.9 means the update leans on few tokens: the sampler drifts from the trainer (staleness, "
        "a bfloat16 server); a steady fall precedes collapse. Lower max_staleness, or try "
        "vllm_importance_sampling_mode geometric_mask or token_truncate.",
    ),
    Metric(
        "sampling/mismatch_kl",
        "The k3 estimate of KL(sampler ‖ trainer) over trained tokens: the mean of r - 1 - log r, r the importance "
        "ratio. In nats; 0 when they agree.",
        "At staleness 0 it measures the train/inference mismatch alone: about 1e-3 and above points at a dtype or "
        "kernel difference between server and trainer; a growing value at fixed staleness, at the policy moving "
        "faster than the samples arrive.",
    ),
    Metric(
        "sampling/masked_tokens_frac",
        "Fraction of trained tokens the off-policy correction (vllm_importance_sampling_mode) gives weight 0. Under "
        "token_mask, the default, it equals sampling/masked_mean; the truncate modes mask nothing. 0 to 1.",
        "Near 0 is healthy; above a few percent the correction throws away much of the batch.",
    ),
    Metric(
        "sampling/masked_sequences_frac",
        "Fraction of trained samples every token of which the correction gives weight 0 (a sequence mode masks "
        "whole samples). 0 to 1.",
        "A sequence mode masking more than about 10% of the samples: widen [vllm_importance_sampling_clip_min, _max] "
        "or use geometric_mask, whose bound does not tighten with the sequence's length.",
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
)
