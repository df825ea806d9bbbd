"""Which weight sync a run gets from `--sync.*` (sync/factory.py), and the object-store sync's hand-over between the
trainer thread and the producer (publish, then make_current), on stand-in groups with nothing to move."""

import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from entropy_openrlhf.config import from_args
from entropy_openrlhf.sync.base import PolicyRank
from entropy_openrlhf.sync.collective import CollectiveSender, CollectiveSync
from entropy_openrlhf.sync.factory import SYNC_METHODS, make_sender, make_weight_sync, method_class, resolve_method
from entropy_openrlhf.sync.object_store import ObjectStoreSync


class Engines:
    """A rollout group without engines: loads into it are empty, versions are what the sync sets."""

    def __init__(self):
        self.actors: list = []
        self.version = 0
        self.weight_sync = None
        self.tensor_parallel_size = 1


class Policy:
    """A policy group whose one rank exports nothing, and counts its exports and their deadlines."""

    def __init__(self):
        self.exports = 0
        self.deadlines: list[float | None] = []

    def call_all(self, method: str, *args, timeout_s: float | None = None, what: str = "") -> list:
        assert method == "export_weights", method  # the only call an object-store sync makes
        self.exports += 1
        self.deadlines.append(timeout_s)
        return [{}]


def test_auto_is_the_collective_sync():
    assert resolve_method("auto") == "collective"
    assert resolve_method("object_store") == "object_store"
    with pytest.raises(ValueError, match="--sync.method: 'nccl' is not one of auto, object_store, collective"):
        resolve_method("nccl")


@pytest.mark.parametrize(("method", "cls"), [("auto", CollectiveSync), ("collective", CollectiveSync),
                                             ("object_store", ObjectStoreSync)])  # fmt: skip
def test_the_factory_builds_the_method_with_the_run_s_settings_and_attaches_it(method, cls):
    cfg = from_args(["--sync.method", method, "--sync.timeout_s", "42", "--sync.max_chunk_mb", "0.5"])
    engines, policy = Engines(), Policy()
    sync = make_weight_sync(cfg.sync, engines, policy)
    assert type(sync) is cls and sync.method == resolve_method(method)
    assert (sync.timeout_s, sync.max_chunk_mb) == (42.0, 0.5)
    assert engines.weight_sync is sync and sync.policy is policy  # restarted engines come back through it
    assert policy.exports == 0  # building it moves nothing


def test_the_config_names_the_methods_without_loading_them_or_ray():
    """scripts/gpu_check.py reads the config where Ray cannot be imported: SYNC_METHODS names each method's class as a
    string, imported only where a run builds the sync."""
    check = (
        "import sys; sys.modules['ray'] = None\n"
        "from entropy_openrlhf.config import from_args, validate\n"
        "cfg = from_args(['--sync.method', 'object_store']); validate(cfg)\n"
        "assert not [m for m in sys.modules if m.startswith(('entropy_openrlhf.sync.collective',\n"
        "    'entropy_openrlhf.sync.object_store', 'entropy_openrlhf.sync.base'))], sorted(sys.modules)\n"
        "print('ok')\n"
    )
    run = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


def test_a_method_whose_class_says_another_name_is_refused(monkeypatch):
    monkeypatch.setitem(SYNC_METHODS, "broadcast", "entropy_openrlhf.sync.collective:CollectiveSync")
    with pytest.raises(ValueError, match="gives --sync.method 'broadcast' to .*CollectiveSync, whose `method` is"):
        method_class("broadcast")


def test_a_policy_rank_gets_the_sender_of_the_method_the_driver_names():
    here = PolicyRank(torch.nn.Linear(2, 3), rank=1, world_size=2, zero3=False)
    sender = make_sender("collective", here)
    assert type(sender) is CollectiveSender and sender.host is here
    assert sender.run("open", 3, "gloo", 5.0) is None  # a rank other than 0 hosts no store
    assert [name for name, _ in sender.params] == ["weight", "bias"]
    assert sender.run("join") is None  # nothing to join on this rank
    for op in ("_group_settings", "run", "close_all", "params"):  # private, itself, missing, not callable
        with pytest.raises(AttributeError, match=rf"CollectiveSender \(policy rank 1\) has no operation '{op}'"):
            sender.run(op)
    with pytest.raises(ValueError, match="weight sync method 'object_store' runs nothing on the policy ranks"):
        make_sender("object_store", here)
    with pytest.raises(ValueError, match="weight sync method 'nccl' is not one of object_store, collective"):
        make_sender("nccl", here)


def test_object_store_weights_wait_for_the_producer_and_the_newest_wins():
    engines, policy = Engines(), Policy()
    sync = ObjectStoreSync(engines, policy)
    assert sync.make_current() == 0.0 and sync.engine_version == 0  # nothing published yet
    sync.publish(1)
    assert sync.engine_version == 0 and policy.exports == 1  # exported at once, loaded only before a generation
    sync.publish(2)  # the trainer ran ahead: version 1 is never loaded
    assert sync.make_current() >= 0.0 and sync.engine_version == 2
    assert sync.pending is None and sync.make_current() == 0.0 and sync.engine_version == 2
    assert sync.synced is not None and sync.synced[1] == 2  # kept for an engine that restarts


def test_an_export_s_deadline_allows_for_a_training_step_in_flight():
    """The policy's ranks run their calls in order, so an export may start only after a training step: its deadline
    is the sync's timeout plus the step's (--train.step_timeout_s, which the trainer passes), never unbounded."""
    cfg = from_args(["--sync.method", "object_store", "--sync.timeout_s", "42"])
    policy = Policy()
    sync = make_weight_sync(cfg.sync, Engines(), policy, policy_busy_s=1000.0)
    sync.publish(1)
    assert policy.deadlines == [1042.0]
    default = make_weight_sync(cfg.sync, Engines(), Policy())  # built without a step deadline: 300 s allowed
    assert default.policy_deadline_s == 342.0


def test_a_collective_group_is_rebuilt_by_the_next_sync_not_where_the_engine_came_back():
    """An engine back from a restart during a generation (the producer's thread) is only noted; the next sync, on
    the trainer's thread, rebuilds the group: there no training step holds up policy rank 0's part in it."""
    engines = Engines()
    sync = CollectiveSync(engines, Policy())
    sync.engine_back(0, "restarted", engine_version=0, restarted=True, reload=False)
    assert sync._rejoin == {0} and sync.rebuilds == 0


def test_publish_and_make_current_from_two_threads_lose_no_version():
    engines, policy = Engines(), Policy()
    sync = ObjectStoreSync(engines, policy)
    seen: list[int] = []

    def producer() -> None:
        while sync.engine_version < 200:
            sync.make_current()
            seen.append(sync.engine_version)

    thread = threading.Thread(target=producer)
    thread.start()
    for version in range(1, 201):
        sync.publish(version)
    thread.join(timeout=60)
    assert not thread.is_alive(), "the producer never saw the last version"
    assert seen == sorted(seen) and seen[-1] == 200  # versions only move forwards


def test_a_restarted_engine_without_a_copy_or_a_policy_is_a_clear_error():
    engines = Engines()
    sync = ObjectStoreSync(engines)  # weights handed in by the caller (tests, benchmarks): no policy to export
    engines.version = 3
    sync.engine_back(0, "restarted", engine_version=0, restarted=True, reload=False)  # a sync follows: nothing to do
    sync.engine_back(0, "restarted", engine_version=3, restarted=True, reload=True)  # already current
    with pytest.raises(RuntimeError, match="rollout engine 0 restarted; the sync holds no copy of policy version 3"):
        sync.engine_back(0, "restarted", engine_version=0, restarted=True, reload=True)


def test_a_new_sync_method_is_one_file_and_its_line_as_the_guide_shows(tmp_path):
    """docs/guides/extending.md's example, dropped into a copy of the package's sync folder with its line in
    SYNC_METHODS, becomes --sync.method eager_object_store; the factory builds it from the run's flags and it loads
    at publish time."""
    root = Path(__file__).resolve().parents[2]
    readme = (root / "docs" / "guides" / "extending.md").read_text()
    code = re.search(r"```python\n(# entropy_openrlhf/sync/eager_object_store\.py\n.*?)```", readme, re.S)
    line = re.search(r"```python\n# entropy_openrlhf/sync/factory\.py, in SYNC_METHODS\n(.*?)```", readme, re.S)
    assert code and line, "docs/guides/extending.md's 'Add a weight sync method' example is missing"
    package = tmp_path / "entropy_openrlhf"
    shutil.copytree(root / "entropy_openrlhf", package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "sync" / "eager_object_store.py").write_text(code.group(1))
    factory = package / "sync" / "factory.py"
    table = "SYNC_METHODS: dict[str, str] = {\n"
    assert table in factory.read_text()
    factory.write_text(factory.read_text().replace(table, table + line.group(1)))
    check = """
from entropy_openrlhf.config import from_args, validate
from entropy_openrlhf.sync.factory import make_weight_sync
from tests.unit.test_sync_factory import Engines, Policy

cfg = from_args(["--sync.method", "eager_object_store", "--sync.timeout_s", "7"])
validate(cfg)
engines, policy = Engines(), Policy()
sync = make_weight_sync(cfg.sync, engines, policy)
assert type(sync).__name__ == "EagerObjectStoreSync" and sync.timeout_s == 7.0 and engines.weight_sync is sync
sync.publish(3)
assert sync.engine_version == 3 and sync.make_current() == 0.0 and "time/sync" in sync.metrics
print("ok")
"""
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    shutil.copy(Path(__file__), tmp_path / "tests" / "unit" / "test_sync_factory.py")
    for init in (tmp_path / "tests" / "__init__.py", tmp_path / "tests" / "unit" / "__init__.py"):
        init.write_text("")
    run = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
