"""Our objectives inside other RL frameworks, without leaving them.

`integrations.openrlhf`: OpenRLHF's own `train_ppo_ray` with its `PolicyLoss` replaced by one of our registered
objectives (docs/guides/openrlhf.md). Nothing here is imported by the rest of the project.
"""
