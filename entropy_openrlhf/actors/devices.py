"""Which device an actor's process uses: the GPU Ray gave it, or the CPU when it gave none.

Shared by the policy ranks, the reference ranks and the rollout engines, and light on purpose (no torch, no Ray):
the driver's group modules import it too.
"""

from __future__ import annotations

import os

# Ray sets CUDA_VISIBLE_DEVICES to each actor's own GPUs unless this is set (then every process sees the node's GPUs)
NOSET_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def local_device_index(gpu_ids: list, visible_devices_env: str | None, noset: bool) -> int | None:
    """The CUDA device index an actor's process should use, or None for the CPU (Ray gave it no GPU).

    `gpu_ids` is `ray.get_gpu_ids()` in the actor. Normally Ray sets CUDA_VISIBLE_DEVICES to those GPUs, so the first
    one is device 0. With RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES (`noset`) the process sees the node's GPUs and
    the device is the Ray id itself, as in OpenRLHF's launcher; when the node's raylet started with a
    CUDA_VISIBLE_DEVICES list, Ray's ids are entries of that list (ray.get_gpu_ids' docstring), so the index is the
    id's position in it.
    """
    if not gpu_ids:
        return None
    if not noset:
        return 0
    gpu = str(gpu_ids[0]).strip()
    if visible_devices_env:
        visible = [d.strip() for d in visible_devices_env.split(",")]
        if gpu not in visible:
            raise ValueError(f"Ray GPU id {gpu} is not in CUDA_VISIBLE_DEVICES={visible_devices_env!r}")
        return visible.index(gpu)
    return int(gpu)


def accelerator_error(device_index: int | None, cuda_available: bool, ds_accelerator: str | None, node: str) -> str:
    """One line describing a device set-up that cannot work, or "" when it can. Checked before DeepSpeed starts:
    DS_ACCELERATOR picks its device type, and a value carried over from a CPU machine's environment (or the reverse)
    would train on the wrong device or fail deep inside DeepSpeed."""
    if device_index is not None and not cuda_available:
        return (f"Ray gave it a GPU on node {node}, but torch sees no CUDA device there (a CPU-only torch build, or "
                f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")  # fmt: skip
    if cuda_available and ds_accelerator == "cpu":
        return (f"DS_ACCELERATOR=cpu on node {node}, which gives it a CUDA GPU: DeepSpeed would train on the CPU; "
                "unset DS_ACCELERATOR there (it leaked from a CPU machine's environment)")  # fmt: skip
    if not cuda_available and ds_accelerator == "cuda":
        return (f"DS_ACCELERATOR=cuda on node {node}, where it has no CUDA GPU (no GPU from Ray, or none on the node): "
                "unset DS_ACCELERATOR there, or give the group GPUs (--actor.num_gpus_per_worker)")  # fmt: skip
    return ""


def engine_visible_devices(gpu_ids: list | None, visible_devices_env: str | None, noset: bool) -> str | None:
    """CUDA_VISIBLE_DEVICES for an engine's process, or None to leave it as it is. `gpu_ids`: the GPUs Ray gave
    the engine's actor, None outside a Ray actor (an engine built in-process, as the benchmarks do: nothing to
    narrow).

    Ray normally sets CUDA_VISIBLE_DEVICES to the actor's own GPUs. With RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES
    (`noset`) it does not, every engine sees the whole node, and vLLM takes cuda:0 (and 1 for TP 2): the GPUs of
    policy rank 0 and of every other engine. So the engine narrows its own view to the GPUs Ray gave it, before vLLM
    (and its TP worker processes, which inherit the variable) start, as OpenRLHF's vllm_engine.py does. Ray's ids are
    physical device ids (or entries of the raylet's own CUDA_VISIBLE_DEVICES list, checked by the policy ranks'
    `local_device_index`), which is what CUDA_VISIBLE_DEVICES takes.

    An engine actor given no GPU (`--rollout.num_gpus_per_engine 0`) sees none: Ray 2.60 leaves a GPU-less actor
    every GPU of its node (ray#54868), where vLLM would take cuda:0, a policy rank's. The policy and reference ranks
    hide them the same way.
    """
    if gpu_ids is None:
        return None
    if not gpu_ids:
        return ""
    if not noset:
        return None
    ids = [str(g).strip() for g in gpu_ids]
    for gpu in ids:  # raises naming an id the raylet's own device list does not hold
        local_device_index([gpu], visible_devices_env, noset=True)
    return ",".join(ids)
