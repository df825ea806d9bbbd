"""Integration fixtures: one real local Ray on 127.0.0.1 per test session, tiny random models in temp folders."""

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from entropy_openrlhf.cluster import init_ray

    started = init_ray(num_cpus=16)
    yield ray
    if started:
        ray.shutdown()  # ends only the cluster this session started


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from entropy_openrlhf.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny_model")))
