"""Every wait on the policy group has a deadline from a flag: a train step (`--train.step_timeout_s`), a checkpoint's
save and load and the final model's (`--train.save_timeout_s`). A fake group records what each call was given. The
trainer's wait for the producer's batch notices a producer that is gone, and no call in the package waits on Ray or
an actor group without its deadline keyword (read from the code)."""

import ast
import queue
import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import entropy_openrlhf
from entropy_openrlhf.actors.policy import PolicyGroup
from entropy_openrlhf.actors.step_data import TrainSample
from entropy_openrlhf.config import from_args
from entropy_openrlhf.pipeline.checkpoints import Checkpointing
from entropy_openrlhf.pipeline.trainer import Trainer

ROOT = Path(entropy_openrlhf.__file__).parents[1]
SCANNED = ("entropy_openrlhf", "pipelines", "rewards", "scripts", "benchmarks")  # what runs: the package and its users


class Recorder:
    def __init__(self):
        self.calls = []

    def call_all(self, method, *args, timeout_s=None, what=""):
        self.calls.append((method, timeout_s, what))
        return [None]


def test_a_train_step_waits_at_most_step_timeout_s():
    cfg = from_args(["--train.step_timeout_s", "123", "--train.mini_batches", "1", "--rollout.batch_size", "1",
                     "--rollout.n_samples_per_prompt", "2"])  # fmt: skip
    group = object.__new__(PolicyGroup)
    group.cfg, group.actors = cfg, [None]
    seen = {}

    def call_each(method, per_rank, *, timeout_s=None, what=""):
        seen.update(method=method, timeout_s=timeout_s, what=what)
        return [{"train/tokens": 1.0, "loss/policy": 0.0, "loss/entropy_bonus": 0.0}]

    group.call_each = call_each
    group.train_step([TrainSample([1], [2], 0.0, [0.0]), TrainSample([1], [3], 0.0, [0.0])], 0)
    assert seen == {"method": "train_step", "timeout_s": 123.0, "what": "--train.step_timeout_s"}


def test_checkpoints_wait_at_most_save_timeout_s(tmp_path):
    cfg = from_args(["--train.save_timeout_s", "45", "--train.output_dir", str(tmp_path)])
    saver = object.__new__(Checkpointing)
    saver.cfg, saver.policy = cfg, Recorder()
    saver.stream = SimpleNamespace(epoch=0, offset=0)
    saver.entropy_ctl = SimpleNamespace(state_dict=lambda: {})
    try:
        saver.save(1, (0, 0))
    except Exception:  # noqa: BLE001 - the fake group writes nothing; only the calls it was given matter here
        pass
    assert [(m, t, w) for m, t, w in saver.policy.calls] == [
        ("save_checkpoint", 45.0, "--train.save_timeout_s"),
        ("save_hf", 45.0, "--train.save_timeout_s"),
    ]


def test_the_trainer_notices_a_producer_that_ended_without_a_batch():
    trainer = object.__new__(Trainer)
    trainer.queue = queue.Queue()
    gone = threading.Thread(target=lambda: None)
    gone.start()
    gone.join(timeout=10)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="the rollout producer ended without handing over the batch for step 7"):
        trainer._next_batch(gone, 7)
    assert time.monotonic() - t0 < 30  # one poll of 5 s, with slack


def test_the_trainer_takes_a_batch_handed_over_just_before_the_producer_ended():
    trainer = object.__new__(Trainer)
    trainer.queue = queue.Queue()
    producer = threading.Thread(target=lambda: (time.sleep(6.0), trainer.queue.put("batch")))
    producer.start()
    try:
        assert trainer._next_batch(producer, 0) == "batch"  # past one empty poll, and the thread has ended
    finally:
        producer.join(timeout=30)


# Calls that wait on Ray or on an actor group, and the keyword that bounds each
BOUNDED_BY = {"get": "timeout", "wait": "timeout", "call_all": "timeout_s", "call_each": "timeout_s",
              "on_policy": "timeout_s", "export_weights": "timeout_s"}  # fmt: skip
# ray.get calls that wait on nothing: their refs are ready (a ray.wait returned them), or a wait with a deadline
# elsewhere bounds them; each with where that deadline is
KNOWN_READY = {
    ("entropy_openrlhf/actors/engine.py", "ray.get(item)"): "a sync chunk; the driver waits --sync.timeout_s",
    ("entropy_openrlhf/actors/group.py", "ray.get(ready)"): "ray.wait returned it",
    ("entropy_openrlhf/actors/group.py", "ray.get(refs)"): "every ref finished in the loop above",
    ("entropy_openrlhf/actors/reward.py", "ray.get(ref)"): "ray.wait returned it",
    ("entropy_openrlhf/actors/rollout.py", "ray.get(done[0])"): "ray.wait returned it",
    ("entropy_openrlhf/actors/rollout.py", "ray.get(list(calls))"): "ray.wait returned them all",
    ("entropy_openrlhf/cluster_fit.py", "ray.get(ref)"): "ray.wait returned it",
    ("entropy_openrlhf/ray_waits.py", "ray.get(ref)"): "ray.wait returned it",
    ("entropy_openrlhf/sync/base.py", "ray.get(done)"): "ray.wait returned it",
}


def unbounded_waits(root: Path = ROOT) -> list[str]:
    """Every call under `root`'s scanned folders that waits on Ray (ray.get, ray.wait), an actor group (call_all,
    call_each, a sync's on_policy, export_weights) or the trainer's queue without its deadline keyword, and is not
    known ready."""
    found = []
    for path in sorted(p for folder in SCANNED for p in (root / folder).rglob("*.py")):
        where = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            if isinstance(node.func, ast.Attribute):  # ray.get, group.call_all, self.on_policy, ...
                name, owner = node.func.attr, ast.unparse(node.func.value)
            elif isinstance(node.func, ast.Name):  # sync/object_store.py's export_weights(policy, ...)
                name, owner = node.func.id, ""
            else:
                continue
            if name not in BOUNDED_BY or (name in ("get", "wait") and owner not in ("ray", "self.queue")):
                continue
            if name == "export_weights" and owner:  # a rank's own export (a method), which waits on nothing
                continue
            keywords = {k.arg for k in node.keywords}
            if BOUNDED_BY[name] in keywords or (name == "get" and owner == "self.queue" and "timeout" in keywords):
                continue
            if None in keywords:  # **deadline: a dict that must hold the deadline (checked by the tests above)
                continue
            if (where, ast.unparse(node)) not in KNOWN_READY:
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_wait_in_the_package_or_its_scripts_goes_without_a_deadline():
    assert unbounded_waits() == []


def test_the_scan_finds_an_unbounded_wait(tmp_path):
    for folder in SCANNED:
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__", ".venv*"))
    (tmp_path / "entropy_openrlhf" / "sync" / "planted.py").write_text(
        "import ray\n\n\ndef f(ref, group):\n    group.call_all('export_weights')\n    return ray.get(ref)\n"
    )
    assert unbounded_waits(tmp_path) == [
        "entropy_openrlhf/sync/planted.py:5: group.call_all('export_weights')",
        "entropy_openrlhf/sync/planted.py:6: ray.get(ref)",
    ]
