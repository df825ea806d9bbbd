"""The `--rollout.*` flags: the vLLM engines, their Ray resources, and how many responses they sample and how."""

from __future__ import annotations

import math
from dataclasses import dataclass

from entropy_openrlhf.config.base import _CUSTOM_HELP, Section, _custom_resource_errors, _failed, _ray_amount_errors
from entropy_openrlhf.options import option as _f  # short: every field below uses it
from entropy_openrlhf.rollouts import GROUP_ROLLOUTS, ROLLOUTS, get_group_rollout, get_rollout, load_agent

ROLLOUT_MODES = ("batch", "stream", "partial")


@dataclass
class RolloutConfig(Section):
    num_engines: int = _f(1, "vLLM engines (Ray actors)")
    tensor_parallel_size: int = _f(1, "GPUs per engine (tensor parallelism); 1 on CPU")
    num_cpus_per_engine: float = _f(1.0, "Ray CPUs reserved per engine")
    num_gpus_per_engine: float = _f(0.0, "Ray GPUs per engine (0 on CPU machines)")
    custom_resources: dict = _f({}, _CUSTOM_HELP.format(what="engine", example='{"node_a": 1}'))
    batch_size: int = _f(8, "prompts per RL step")
    n_samples_per_prompt: int = _f(4, "responses per prompt (the GRPO group size)")
    temperature: float = _f(
        1.0,
        "sampling temperature (the paper: 1.0); the trainer's log-probs, entropies and the reference's are those of "
        "the same logits / T, and vLLM returns the sampled distribution's log-probs (docs/algorithms/off_policy.md)",
    )
    top_p: float = _f(
        1.0, "nucleus sampling; only 1 trains: the trainer's log-probs do not truncate the distribution as top_p does"
    )
    max_new_tokens: int = _f(128, "maximum response length in tokens")
    max_model_len: int = _f(1024, "prompt + response tokens the engine accepts")
    generate_timeout_s: float = _f(
        3600.0,
        "an engine whose generate call runs longer is killed, restarted and given its prompts again; raise it for "
        "long responses on large models",
    )
    gpu_memory_utilization: float = _f(
        0.0,
        "share of each engine's GPU memory vLLM fills with weights, CUDA graphs and KV cache; 0 = auto: 0.9 on GPUs "
        "(the engines have their GPUs to themselves), 0.8 on CPU (there a share of the node's RAM, unused while "
        "VLLM_CPU_KVCACHE_SPACE sets the KV cache)",
    )
    enforce_eager: str = _f(
        "auto",
        "run vLLM without CUDA graphs / compilation: auto (false on GPUs, true on CPU) | true | false",
        choices=("auto", "true", "false"),
    )
    enable_prefix_caching: bool = _f(True, "vLLM prefix caching: the n samples of a prompt share its KV blocks")
    max_num_seqs: int = _f(0, "most sequences an engine runs at once (0 = vLLM's default for the device)")
    max_num_batched_tokens: int = _f(0, "most tokens an engine processes per step (0 = vLLM's default for the device)")
    function: str = _f(
        "single_turn",
        "how a batch of prompts becomes groups of responses: a registered rollout function ("
        + " | ".join(
            [*ROLLOUTS, *(f"{name} (stream and partial mode)" for name in GROUP_ROLLOUTS if name not in ROLLOUTS)]
        )
        + ") or package.module:function (entropy_openrlhf/rollouts; docs/guides/tools.md for python_tool)",
    )
    agent_file: str = _f(
        "", "--rollout.function openrlhf_agent: the OpenRLHF agent file (an AgentInstance with async reset/step) whose "
        "episodes it runs (docs/guides/tools.md)",
    )  # fmt: skip
    mode: str = _f(
        "batch",
        "batch: each step's prompts in one generate call, weights synced between calls | stream: groups sent to the "
        "engines continuously and scored as each finishes, finished groups buffered for the trainer, a weight sync "
        "waiting for the requests in flight | partial: as stream, but a sync freezes the requests in flight, loads the "
        "new weights and resumes them, so a response may be sampled by two or more versions "
        "(docs/guides/streaming.md)",
        choices=ROLLOUT_MODES,
    )
    partial_kv: str = _f(
        "keep",
        "--rollout.mode partial: after weights change under a request in flight, keep the KV cache the old weights "
        "computed (PipelineRL, prime-rl) or recompute it with the new ones (verl, AReaL): keep | recompute",
        choices=("keep", "recompute"),
    )

    def checks(self) -> list[str]:
        gmu, tp = self.gpu_memory_utilization, self.tensor_parallel_size
        try:
            function_error = ""
            if self.mode == "batch":
                get_rollout(self.function)
            else:  # the group coroutine; a batch form is optional (python_tool has none)
                get_group_rollout(self.function)
        except ValueError as e:
            function_error = str(e).removeprefix(f"--rollout.function {self.function!r}: ")
        agent_error = ""
        if self.function == "openrlhf_agent":
            try:
                load_agent(self.agent_file)
            except ValueError as e:
                agent_error = str(e).removeprefix(f"--rollout.agent_file {self.agent_file}: ")
        return (
            _failed((not function_error, "rollout.function", function_error))
            + _failed((not agent_error, "rollout.agent_file", f"{self.agent_file!r}: {agent_error}"))
            + _failed(
                (self.batch_size >= 1, "rollout.batch_size", "must be >= 1"),
                (self.n_samples_per_prompt >= 1, "rollout.n_samples_per_prompt", "must be >= 1"),
                (self.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1"),
                (
                    0 < self.temperature < math.inf,
                    "rollout.temperature",
                    f"{self.temperature:g} must be > 0 and finite",
                ),
                (0 < self.top_p <= 1, "rollout.top_p", "must be in (0, 1]"),
                # vLLM's log-probs would be those of the renormalised nucleus, the trainer's of the whole vocabulary
                # at T: the importance ratio and PPO's ratio would mix two distributions
                (
                    not 0 < self.top_p < 1,
                    "rollout.top_p",
                    f"{self.top_p:g} is refused in training: the trainer computes log-probs over the whole vocabulary "
                    "(at --rollout.temperature), not over the nucleus top_p keeps, so pi_old and pi_rollout would be "
                    "different distributions; use 1",
                ),
                (self.num_engines >= 1, "rollout.num_engines", "must be >= 1"),
                (self.generate_timeout_s > 0, "rollout.generate_timeout_s", f"{self.generate_timeout_s:g} must be > 0"),
                (0 <= gmu <= 1, "rollout.gpu_memory_utilization", f"{gmu:g} must be in (0, 1], or 0 for auto"),
                (self.max_num_seqs >= 0, "rollout.max_num_seqs", "must be >= 0 (0 = vLLM's default)"),
                (
                    self.max_num_batched_tokens >= 0,
                    "rollout.max_num_batched_tokens",
                    "must be >= 0 (0 = vLLM's default)",
                ),
                (
                    not (0 < self.max_num_batched_tokens < self.max_num_seqs),
                    "rollout.max_num_batched_tokens",
                    f"{self.max_num_batched_tokens} is below --rollout.max_num_seqs {self.max_num_seqs}: every "
                    "running sequence needs a token per step (vLLM refuses this)",
                ),
                (tp >= 1, "rollout.tensor_parallel_size", "must be >= 1"),
                (
                    self.num_gpus_per_engine == 0 or self.num_gpus_per_engine >= tp,
                    "rollout.tensor_parallel_size",
                    f"{tp} needs --rollout.num_gpus_per_engine >= {tp} (one GPU per shard), got "
                    f"{self.num_gpus_per_engine:g}",
                ),
            )
            + _ray_amount_errors(self, "rollout", "num_gpus_per_engine", "num_cpus_per_engine")
            + _custom_resource_errors(self.custom_resources, "rollout")
        )
