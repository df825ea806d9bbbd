"""Every wait on the policy group has a deadline from a flag: a train step (`--train.step_timeout_s`), a checkpoint's
save and load and the final model's (`--train.save_timeout_s`). A fake group records what each call was given."""

from types import SimpleNamespace

from entropy_openrlhf.actors.policy import PolicyGroup
from entropy_openrlhf.actors.step_data import TrainSample
from entropy_openrlhf.config import from_args
from entropy_openrlhf.pipeline.checkpoints import Checkpointing


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
