"""An OpenRLHF agent file (what OpenRLHF's --train.agent_func_path takes), written only against OpenRLHF's interface:
the model answers, and when the answer does not end with the label it is told so and tries once more. Run here with

    python pipelines/grpo.py --rollout.function openrlhf_agent --rollout.mode stream \\
        --rollout.agent_file rewards/examples/openrlhf_agent_retry.py --reward.verifier agent
"""

import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

TRIES = 2


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.tries = 0

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        self.tries += 1
        right = states["action_text"].strip().endswith(str(states["label"]))
        done = right or self.tries >= TRIES
        reward = torch.tensor(1.0 if right else 0.0)
        return {
            "rewards": reward,
            "scores": reward,
            "environment_feedback": "" if done else "\nThat is not right. Try again:\n",
            "done": done,
            "sampling_params": states.get("sampling_params"),
            "extra_logs": {"tries": torch.tensor(float(self.tries))},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
