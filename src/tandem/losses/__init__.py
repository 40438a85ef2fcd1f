"""Training objectives: GRPO's clipped surrogate, score centering, and FlashREINFORCE's reference loss."""

from tandem.losses.flash_reinforce import flash_reinforce_loss

__all__ = ["flash_reinforce_loss"]
