"""Which checkpoint a resume picks: only complete step<N> folders, never a save that was cut short."""

import json
from pathlib import Path

from entropy_openrlhf.pipeline.checkpoints import latest_checkpoint


def make(root: Path, name: str, complete: bool = True) -> Path:
    path = root / name
    (path / "deepspeed").mkdir(parents=True)
    if complete:
        (path / "trainer_state.json").write_text(json.dumps({"step": 0}))
    return path


def test_highest_complete_step_wins_numerically(tmp_path):
    make(tmp_path, "step2")
    make(tmp_path, "step10")
    make(tmp_path, "step9")
    assert latest_checkpoint(tmp_path) == tmp_path / "step10"  # 10 > 9 although "step10" < "step9" as text


def test_temporary_old_and_incomplete_folders_are_never_picked(tmp_path):
    make(tmp_path, "step4")
    make(tmp_path, ".tmp-step8")  # a save cut short: complete-looking, but never renamed
    make(tmp_path, ".old-step6")  # a copy being replaced
    make(tmp_path, "step12", complete=False)  # no trainer_state.json
    make(tmp_path, "step7-backup")
    make(tmp_path, "stepX")
    (tmp_path / "step20").write_text("a file, not a folder")
    assert latest_checkpoint(tmp_path) == tmp_path / "step4"


def test_nothing_to_resume(tmp_path):
    assert latest_checkpoint(tmp_path / "absent") is None
    assert latest_checkpoint(tmp_path) is None
    make(tmp_path, ".tmp-step2")
    assert latest_checkpoint(tmp_path) is None


def test_rotation_keeps_the_newest_complete_checkpoints(tmp_path):
    from entropy_openrlhf.pipeline.checkpoints import rotate_checkpoints

    for step in (2, 4, 10, 6):
        make(tmp_path, f"step{step}")
    make(tmp_path, "step12", complete=False)  # not complete: neither counted nor deleted
    make(tmp_path, ".tmp-step14")
    make(tmp_path, ".del-step1")  # left by a run killed while deleting
    deleted = rotate_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in deleted) == ["step2", "step4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-step14", "step10", "step12", "step6"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step10"  # resume still finds the newest


def test_rotation_off_keeps_everything(tmp_path):
    from entropy_openrlhf.pipeline.checkpoints import rotate_checkpoints

    for step in (2, 4, 6):
        make(tmp_path, f"step{step}")
    assert rotate_checkpoints(tmp_path, keep=0) == []
    assert len(list(tmp_path.iterdir())) == 3
