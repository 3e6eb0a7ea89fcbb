"""Reinforcement learning over a trained model with a verifier's reward, and the learned prior over Z.

config.py    RLConfig: the settings of `free-transformer rl` (steps=N, group=G, ...)
episode.py   what a reward task is: episodes (a prompt, its reward callable (prompt ids, tokens) -> float), `score`
rewards.py   the reward tasks by name: letters, coins, and eval:TASK
eval_reward.py  eval:TASK: a generative eval task's documents as prompts, its own checker as the reward
rollout.py   the step-by-step sampling loop, with Z from the prior or the policy head, and the features
             the updates recompute log-probabilities from
grpo.py      group-relative advantages and the clipped GRPO loss with its KL penalty
prior.py     the learned prior: the head trained to match the encoder's posterior, decoder frozen
trainer.py   the loop: progress, SIGTERM, --resume, metrics.jsonl, curves, torchrun
"""
