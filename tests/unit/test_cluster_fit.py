"""The fit check against a Ray cluster's resources: scale logical CPUs on CPU-only clusters, fail in one line
naming the flags otherwise. Pure logic: the cluster is given as Ray reports it (free resources, per-node totals)."""

import pytest

from entropy_openrlhf.cluster_fit import ClusterFitError, fit_cluster, group_needs
from entropy_openrlhf.config import Config, from_args
from entropy_openrlhf.presets import PIPELINES


def smoke(*flags: str) -> Config:
    # the reference on, as a run with a KL term has it: four groups to fit (by default only a KL term starts it)
    return from_args(["--preset", "smoke", "--ref.enabled", "true", *flags], PIPELINES["kl_cov"])


def reserved_cpus(cfg: Config) -> float:
    return sum(g.actors * g.bundle["CPU"] for g in group_needs(cfg))


def test_a_laptop_head_scales_cpu_reservations_to_fit():
    cfg = smoke()
    assert reserved_cpus(cfg) == 1 + 1 + 0.5 + 0.25  # engine, policy rank, reference, one verifier worker
    note = fit_cluster(cfg, {"CPU": 2.0}, [{"CPU": 2.0}])  # `ray start --head --num-cpus 2`
    assert note and "2.75 CPUs" in note and "scaled" in note
    assert 0 < reserved_cpus(cfg) <= 2.0
    for g in group_needs(cfg):  # what Ray accepts: a fraction <= 1 or a whole number
        assert g.bundle["CPU"] > 0 and (g.bundle["CPU"] <= 1 or float(g.bundle["CPU"]).is_integer())
    # the proportions stay: the engine still gets twice the reference's share (up to rounding down)
    assert cfg.rollout.num_cpus_per_engine == pytest.approx(2 * cfg.ref.num_cpus, abs=0.002)


def test_enough_cpus_changes_nothing():
    cfg = smoke()
    assert fit_cluster(cfg, {"CPU": 16.0}, [{"CPU": 16.0}]) is None
    assert reserved_cpus(cfg) == 2.75


def test_a_bundle_larger_than_every_node_is_scaled_on_cpu_only_clusters():
    cfg = smoke("--rollout.num_cpus_per_engine", "8")
    note = fit_cluster(cfg, {"CPU": 12.0}, [{"CPU": 4.0}, {"CPU": 4.0}, {"CPU": 4.0}])
    assert note and cfg.rollout.num_cpus_per_engine <= 4


def test_missing_gpus_fail_in_one_line_naming_the_flags():
    cfg = smoke("--actor.num_gpus_per_worker", "1", "--rollout.num_gpus_per_engine", "1", "--actor.num_workers", "2")
    with pytest.raises(ClusterFitError) as e:
        fit_cluster(cfg, {"CPU": 64.0, "GPU": 1.0}, [{"CPU": 64.0, "GPU": 1.0}])
    msg = str(e.value)
    assert "\n" not in msg
    assert "needs 4 GPUs, the cluster has 1 free" in msg  # the reference follows the policy onto a GPU
    assert "--rollout.num_engines x --rollout.num_gpus_per_engine" in msg
    assert "--actor.num_workers x --actor.num_gpus_per_worker" in msg
    assert "reference 1 (--ref.num_workers x --ref.num_gpus)" in msg


def test_gpus_on_a_cpu_only_cluster_fail_rather_than_wait():
    cfg = smoke("--actor.num_gpus_per_worker", "1")
    with pytest.raises(ClusterFitError, match="needs 2 GPUs, the cluster has 0 free: policy 1 .*, reference 1"):
        fit_cluster(cfg, {"CPU": 2.0}, [{"CPU": 2.0}])


def test_cpus_short_on_a_gpu_cluster_fail_naming_groups():
    cfg = smoke("--rollout.num_gpus_per_engine", "1", "--actor.num_gpus_per_worker", "1")
    with pytest.raises(ClusterFitError, match=r"needs 2.75 CPUs, the cluster has 2 free: rollout 1 \(--rollout"):
        fit_cluster(cfg, {"CPU": 2.0, "GPU": 2.0}, [{"CPU": 2.0, "GPU": 2.0}])


def test_an_engine_must_fit_on_one_node():
    # 4 GPUs in all, but a TP-4 engine needs them on one node
    cfg = smoke("--rollout.tensor_parallel_size", "4", "--rollout.num_gpus_per_engine", "4")
    nodes = [{"CPU": 8.0, "GPU": 2.0}, {"CPU": 8.0, "GPU": 2.0}]
    with pytest.raises(ClusterFitError, match="one rollout actor needs 1 CPU, 4 GPU on a single node"):
        fit_cluster(cfg, {"CPU": 16.0, "GPU": 4.0}, nodes)


def test_custom_resources_are_checked():
    cfg = smoke("--rollout.custom_resources", '{"node_a": 1}', "--actor.custom_resources", '{"node_b": 1}')
    nodes = [{"CPU": 2.0, "node_a": 100.0}, {"CPU": 2.0, "node_b": 100.0}]
    fit_cluster(cfg, {"CPU": 4.0, "node_a": 100.0, "node_b": 100.0}, nodes)
    with pytest.raises(ClusterFitError, match="resource 'node_b'.*--actor.custom_resources"):
        fit_cluster(cfg, {"CPU": 4.0, "node_a": 100.0}, nodes[:1])


def test_bad_custom_resources_name_the_flag():
    from entropy_openrlhf.config import ConfigError, validate

    for value, why in (('{"GPU": 1}', "own flags"), ('{"node_a": 1.5}', "whole number"), ('{"x": "a"}', "number")):
        cfg = smoke("--reward.custom_resources", value)
        with pytest.raises(ConfigError, match=rf"--reward.custom_resources: .*{why}"):
            validate(cfg)


def test_the_node_check_names_each_problem(tmp_path):
    from entropy_openrlhf.cluster_fit import _check_node

    check = _check_node._function  # the plain function Ray runs on each node
    model, out = tmp_path / "model", tmp_path / "out"
    model.mkdir()
    out.mkdir()
    (out / ".token").write_text("abc")
    assert check(str(model), str(out), ".token", "abc") == [f"--pretrain {model}: no HF model there (no config.json)"]
    (model / "config.json").write_text("{}")
    assert check(str(model), None, ".token", "abc") == [
        f"--pretrain {model}: config.json but no weights (.safetensors or .bin)"
    ]
    (model / "model.safetensors").write_bytes(b"")
    assert check(str(model), str(out), ".token", "abc") == []
    # another node's disk: the folder exists and is writable, but it is not the one the driver wrote the token to
    (out / ".token").write_text("written by another driver")
    [problem] = check(None, str(out), ".token", "abc")
    assert problem.startswith(f"--train.output_dir {out} is not the folder the driver writes to")
    blocked = tmp_path / "a-file"  # root writes anywhere: a file in the folder's place makes the write fail
    blocked.write_text("")
    [problem] = check(None, str(blocked), ".token", "abc")
    assert problem.startswith(f"--train.output_dir {blocked} is not writable")
