"""What a rollout engine imports in its own process only: vLLM, and the check of the policy's weight names, which
builds the model class with transformers (weight_names.py).

Both read settings when imported (vLLM its VLLM_* variables, transformers HF_HUB_OFFLINE) that the engine's
`set_cpu_defaults` sets first, so RolloutEngine's constructor imports this module after it, its one import inside a
function. The driver imports engine.py to spawn the engines and never this module (vLLM alone is ~7.5 s of CPU and
~380 MB on top of what the driver holds).
"""

import vllm.envs as vllm_envs
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
from vllm.sampling_params import RequestOutputKind

from entropy_openrlhf.actors.weight_names import check_weight_names

__all__ = ["LLM", "LoRARequest", "RequestOutputKind", "SamplingParams", "check_weight_names", "vllm_envs"]
