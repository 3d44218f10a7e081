"""Reinforcement learning: GRPO and its variants with in-process rollouts.

The policy that trains is the policy that samples: :class:`Rollouts` draws
completions from the :class:`~maxnnx.train.Trainer`'s live model on its mesh,
scores them with Python reward functions (:class:`Rewards`), and feeds the
Trainer batches for :class:`GRPOObjective` (losses in :mod:`maxnnx.rl.losses`).
:class:`GRPO` puts the three together; ``python -m maxnnx grpo`` is the CLI.
"""

from maxnnx.rl.grpo import GRPO, GRPOConfig, grpo_objective, make_rollouts
from maxnnx.rl.losses import LOSS_TYPES, group_advantages, policy_loss
from maxnnx.rl.objective import GRPOObjective
from maxnnx.rl.prompts import Prompt, Prompts
from maxnnx.rl.rewards import RewardError, Rewards, exact_match, load_reward, one_word_in_capitals
from maxnnx.rl.rollouts import Rollouts

__all__ = ['GRPO', 'GRPOConfig', 'GRPOObjective', 'LOSS_TYPES', 'Prompt', 'Prompts',
           'RewardError', 'Rewards', 'Rollouts', 'exact_match', 'group_advantages',
           'grpo_objective', 'load_reward', 'make_rollouts', 'one_word_in_capitals',
           'policy_loss']
