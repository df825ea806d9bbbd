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
    env = cluster.actor_env()
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["VLLM_HOST_IP"] == "127.0.0.1"
    assert env["DS_ACCELERATOR"] == "cpu"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"  # the user's setting wins over the default


def test_a_submitted_job_adds_no_runtime_env(no_cuda, monkeypatch):
    # The job's own runtime env (ray job submit --runtime-env-json) reaches the actors; a second one from
    # ray.init(runtime_env=...) makes Ray's merge fail when both set env_vars, and would push this node's
    # loopback or CPU settings onto other nodes.
    import ray

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    os.environ["RAY_JOB_ID"] = "02000000"
    os.environ["WANDB_API_KEY"] = "fake"
    assert cluster.init_ray() is False  # joined, not started: the caller must not shut it down
    assert calls == [{"address": "auto"}]


def test_set_cpu_defaults_only_without_cuda(monkeypatch, no_cuda):
    os.environ["DS_ACCELERATOR"] = "xpu"
    cluster.set_cpu_defaults()
    assert os.environ["DS_ACCELERATOR"] == "xpu"  # already set: kept
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"

    del os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    monkeypatch.setattr(cluster, "has_cuda", lambda: True)
    cluster.set_cpu_defaults()
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
