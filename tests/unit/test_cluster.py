"""Which environment the actors get: loopback only on a cluster we started here; CPU settings decided per node."""

from __future__ import annotations

import os

import pytest

from entropy_openrlhf import cluster


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(cluster, "has_cuda", lambda: False)
    # a private copy of the environment, so what set_cpu_defaults writes is gone after the test
    env = {k: v for k, v in os.environ.items() if k not in cluster.CPU_DEFAULT_ENV and k != "WANDB_MODE"}
    monkeypatch.setattr(os, "environ", env)


def test_local_cluster_gets_loopback_and_cpu_defaults(no_cuda, monkeypatch):
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "3"
    env = cluster.actor_env(local=True)
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["VLLM_HOST_IP"] == "127.0.0.1"
    assert env["DS_ACCELERATOR"] == "cpu"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"  # the user's setting wins over the default


def test_joined_cluster_gets_neither_loopback_nor_cpu_settings(no_cuda, monkeypatch):
    # a CPU-only driver node must not send DS_ACCELERATOR=cpu to GPU workers, nor 127.0.0.1 to other nodes
    os.environ["WANDB_MODE"] = "offline"
    env = cluster.actor_env(local=False)
    assert env == {"WANDB_MODE": "offline"} | ({"PYTHONPATH": env["PYTHONPATH"]} if "PYTHONPATH" in env else {})


def test_set_cpu_defaults_only_without_cuda(monkeypatch, no_cuda):
    os.environ["DS_ACCELERATOR"] = "xpu"
    cluster.set_cpu_defaults()
    assert os.environ["DS_ACCELERATOR"] == "xpu"  # already set: kept
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"

    del os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    monkeypatch.setattr(cluster, "has_cuda", lambda: True)
    cluster.set_cpu_defaults()
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
