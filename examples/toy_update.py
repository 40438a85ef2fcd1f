"""One FlashREINFORCE update on CPU with the standalone reference loss (tandem.losses.flash_reinforce_loss).

A toy policy (one categorical distribution per position, 8 actions) produces a batch of 6 trajectories
of different lengths; a slightly different "sampler" provides the behaviour log-probs; rewards are 1 for
trajectories that mostly chose action 0. One AdamW step follows, and the script prints the loss, the
acceptance rate of the Sequence Trust Region gate, and how the policy's probability of action 0 moved.

    python examples/toy_update.py
"""

import torch

from tandem.losses import flash_reinforce_loss


def main() -> None:
    torch.manual_seed(0)
    batch, steps, actions = 6, 12, 8
    logits = torch.nn.Parameter(torch.zeros(steps, actions))
    behaviour_logits = logits.detach() + 0.05 * torch.randn(steps, actions)  # the sampler lags a little
    lengths = torch.tensor([3, 12, 7, 1, 9, 5])
    mask = torch.arange(steps)[None] < lengths[:, None]
    sampled = torch.multinomial(behaviour_logits.softmax(-1), batch, replacement=True).T  # [batch, steps]
    rewards = ((sampled == 0) | (sampled == 1)).float().mul(mask).sum(-1).div(lengths).gt(0.25).float()

    log_probs = logits.log_softmax(-1).expand(batch, -1, -1).gather(2, sampled[..., None])[..., 0]
    behaviour = behaviour_logits.log_softmax(-1).expand(batch, -1, -1).gather(2, sampled[..., None])[..., 0]
    loss, diagnostics = flash_reinforce_loss(log_probs, behaviour, rewards, mask, delta=3e-3)

    optimizer = torch.optim.AdamW([logits], lr=0.05)
    before = logits.detach().softmax(-1)[:, 0].mean()
    loss.backward()
    optimizer.step()
    after = logits.detach().softmax(-1)[:, 0].mean()

    print(f"rewards          {rewards.tolist()}")
    print(f"loss             {loss.item():+.6f}")
    print(
        f"acceptance rate  {diagnostics['acceptance_rate'].item():.3f}  (sequence KL {[round(x, 5) for x in diagnostics['sequence_kl'].tolist()]})"
    )
    print(f"retained tokens  {diagnostics['retained_tokens'].tolist()} of {diagnostics['policy_tokens'].tolist()}")
    print(f"P(action 0)      {before:.4f} -> {after:.4f}")


if __name__ == "__main__":
    main()
