"""How a run stops when it cannot go on: a lost node, or SIGTERM to the driver (docs/guides/reliability.md).

The pieces that need no cluster: which nodes count as lost and what the message says they held, the resume command
the driver prints, and the removal of a save that the stop cut short. The runs themselves are stopped for real in
tests/integration/test_sigterm.py (SIGTERM to a local run) and tests/multinode/test_two_nodes.py (node b lost).
"""

import shlex
from pathlib import Path

import pytest

from entropy_openrlhf.cluster import LostNode, lost_nodes
from entropy_openrlhf.config import Config
from entropy_openrlhf.pipeline.checkpoints import latest_checkpoint
from entropy_openrlhf.pipeline.faults import NodeLostError
from entropy_openrlhf.pipeline.run import StopRequested, resume_command, signal_behind
from entropy_openrlhf.pipeline.trainer import Trainer


def node(node_id: str, address: str, alive: bool) -> dict:
    return {"NodeID": node_id, "NodeManagerAddress": address, "Alive": alive}


def test_node_lost_names_only_dead_nodes_that_held_actors_and_what_each_held():
    placement = {
        "rollout": ["A"],
        "policy": ["B", "B"],
        "reward": ["A", "B"],
        "reference": ["B"],
    }
    nodes = [node("A", "198.18.0.1", True), node("B", "198.18.0.2", False), node("C", "198.18.0.3", False)]
    [lost] = lost_nodes(placement, nodes)  # C is dead too, but held nothing of this run
    assert (lost.node_id, lost.address) == ("B", "198.18.0.2")
    assert lost.held() == "policy ranks 0, 1; reward worker 1; reference rank 0"
    assert lost_nodes(placement, [node("A", "198.18.0.1", True), node("B", "198.18.0.2", True)]) == []


def test_node_lost_when_ray_no_longer_lists_the_node():
    # Ray forgets dead nodes after a while: a node missing from ray.nodes() is as lost as one marked dead
    [lost] = lost_nodes({"policy": ["A", "Z"]}, [node("A", "198.18.0.1", True)])
    assert (lost.node_id, lost.address, lost.actors) == ("Z", "?", {"policy": [1]})


def test_node_lost_error_message_names_node_step_and_actors():
    lost = LostNode("b" * 56, "198.18.0.2", {"policy": [0, 1], "reference": [0]})
    message = str(NodeLostError([lost], step=2, seconds_after=3.4))
    assert message == (
        "lost node 198.18.0.2 (Ray node bbbbbbbbbbbb), which held policy ranks 0, 1; reference rank 0, during step 2; "
        "the run stopped 3 s after Ray declared it dead"
    )


@pytest.mark.parametrize("resume_flag", [[], ["--train.resume", "false"], ["--train.resume=false"]])
def test_sigterm_resume_command_keeps_every_flag_and_asks_for_resume(resume_flag, monkeypatch):
    monkeypatch.setattr("sys.argv", ["pipelines/clip_cov.py"])
    for name in ("RAY_JOB_ID", "RAY_JOB_CONFIG_JSON_ENV_VAR"):
        monkeypatch.delenv(name, raising=False)
    argv = ["--preset", "smoke", *resume_flag, "--train.output_dir", "out dir/run", "--actor.lr", "-1e-5"]
    command = shlex.split(resume_command("clip_cov", argv))
    assert command == [
        "python", "pipelines/clip_cov.py", "--preset", "smoke", "--train.output_dir", "out dir/run",
        "--actor.lr", "-1e-5", "--train.resume", "true",
    ]  # fmt: skip
    # the driver of a submitted job (what Ray's job supervisor sets): the same command, submitted again
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")
    assert resume_command("clip_cov", argv).startswith("ray job submit <your options> -- python pipelines/clip_cov.py")


class PolicyStoppedMidSave:
    """A policy group whose DeepSpeed save is under way when SIGTERM arrives: some files are written, then the
    driver's wait for the ranks is interrupted."""

    actors: list = []  # no rank left to wait for

    def call_all(self, method: str, path: str, tag: str, **deadline) -> list:
        assert method == "save_checkpoint", method  # the save's first call on the ranks
        Path(path, tag).mkdir(parents=True)
        Path(path, tag, "mp_rank_00_model_states.pt").write_bytes(b"half")
        raise StopRequested("SIGTERM")


def test_sigterm_during_a_save_leaves_no_partial_checkpoint(tmp_path):
    cfg = Config()
    cfg.train.output_dir = str(tmp_path)
    trainer = Trainer(cfg, "unused", [], [])
    root = tmp_path / "checkpoints"
    (root / "step1").mkdir(parents=True)
    (root / "step1" / "trainer_state.json").write_text("{}")
    trainer.policy = PolicyStoppedMidSave()
    with pytest.raises(StopRequested):
        trainer.save(2, (0, 0))
    assert (root / ".tmp-step2").is_dir()  # what the stop leaves until the driver's clean-up
    assert trainer.discard_unfinished_save() == root / ".tmp-step2"
    assert sorted(p.name for p in root.iterdir()) == ["step1"]
    assert latest_checkpoint(root) == root / "step1"
    assert trainer.discard_unfinished_save() is None  # nothing left to remove


class WatchStub:
    """A node watch that has seen nothing yet, and whose verdict, if asked for, is `verdict`."""

    def __init__(self, verdict: list[LostNode]):
        self.lost: list[LostNode] = []
        self._verdict, self.waited_s = verdict, None

    def check(self) -> list[LostNode]:
        return self.lost

    def verdict(self, timeout_s: float) -> list[LostNode]:
        self.waited_s = timeout_s
        return self._verdict


def test_node_lost_verdict_is_awaited_only_after_a_call_to_an_unreachable_actor():
    import ray.exceptions

    from entropy_openrlhf.cluster import NODE_VERDICT_S
    from entropy_openrlhf.sync.base import WeightSyncTimeoutError

    trainer = Trainer(Config(), "unused", [], [])
    b = LostNode("b" * 56, "198.18.0.2", {"policy": [0, 1]})
    # what the producer hands the trainer when the reference on the lost node does not answer: the cause is chained
    failure = RuntimeError("rollout producer failed: ...")
    failure.__cause__ = ray.exceptions.ActorUnavailableError("the actor is temporarily unavailable", None)
    watch = WatchStub([b])
    assert trainer._lost_nodes_behind(failure, watch) == [b]
    assert watch.waited_s == NODE_VERDICT_S
    # no sign of a lost node: raised at once, as before (a stalled sync keeps its own deadline)
    for error in (WeightSyncTimeoutError("weight sync timed out"), ValueError("a bug"), KeyboardInterrupt()):
        watch = WatchStub([b])
        assert trainer._lost_nodes_behind(error, watch) == [] and watch.waited_s is None, error
    # once the watch has seen the loss, any error is explained by it
    watch = WatchStub([])
    watch.lost = [b]
    assert trainer._lost_nodes_behind(ValueError("a collective broken by the lost peer"), watch) == [b]


def raised_inside(inner: BaseException, outer: type[BaseException]) -> BaseException:
    """`outer` raised while `inner` was being handled, as Ray's Cython wait turns a signal handler's exception into
    a SystemError (seen on a SIGTERM during an evaluation)."""
    try:
        try:
            raise inner
        except BaseException as e:
            raise outer("returned a result with an exception set") from e
    except BaseException as e:
        return e


def test_a_signal_behind_a_system_error_is_found_as_the_stop_it_was():
    stop = StopRequested("SIGTERM")
    assert signal_behind(raised_inside(stop, SystemError)) is stop
    interrupt = KeyboardInterrupt()
    assert signal_behind(raised_inside(interrupt, SystemError)) is interrupt
    assert signal_behind(stop) is stop
    assert signal_behind(SystemError("a real one")) is None  # re-raised by the driver, not taken for a stop
    assert signal_behind(raised_inside(ValueError("x"), SystemError)) is None
