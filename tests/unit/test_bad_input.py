"""Bad input through the real entry point (`pipeline.main.main`, what pipelines/*.py run): each case exits with code
2 and one line on stderr naming the file, row, field or flag, before Ray or any actor starts."""

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from entropy_openrlhf.config import from_args
from entropy_openrlhf.pipeline.main import main
from entropy_openrlhf.pipeline.run import prepare

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from entropy_openrlhf.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture
def no_ray(monkeypatch):
    """Starting Ray (locally or by joining a cluster) fails the test: bad input must be refused before it."""
    import ray

    import entropy_openrlhf.cluster
    import entropy_openrlhf.pipeline.run

    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started for a run whose input is bad")

    monkeypatch.setattr(entropy_openrlhf.cluster, "init_ray", refuse)
    monkeypatch.setattr(entropy_openrlhf.pipeline.run, "init_ray", refuse)  # the run's own name for it
    monkeypatch.setattr(ray, "init", refuse)


def run(argv: list[str], capsys) -> tuple[int, str]:
    """main's exit code (argparse exits by SystemExit) and what it wrote to stderr."""
    try:
        code = main(argv, "kl_cov")
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def cases(tmp: Path) -> list[tuple[list[str], list[str]]]:
    """(flags, words the message must hold)."""
    good = {"prompt": "What is 2 + 2?", "label": "4"}
    long = {"prompt": "two plus two " * 800, "label": "4"}
    latin1 = tmp / "latin1.jsonl"
    latin1.write_bytes(b'{"prompt": "caf\xe9 au lait?", "label": "1"}\n')
    empty = tmp / "empty.jsonl"
    empty.write_text("")
    (tmp / "no_model").mkdir()
    no_tokenizer = tmp / "no_tokenizer"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 32}))
    for run, state in (("torn", '{"step": 2, "seed"'), ("earlier", '{"step": 2, "seed": 42}')):
        (tmp / run / "checkpoints" / "step2").mkdir(parents=True)  # an output folder with a checkpoint in it
        (tmp / run / "checkpoints" / "step2" / "trainer_state.json").write_text(state)
    broken = tmp / "broken_verifier.py"
    broken.write_text("import a_module_that_is_not_there\n\ndef verify(response, label, **kw):\n    return 1.0\n")
    wrong_shape = tmp / "wrong_shape.py"  # verl's old habit of a bare dict of extras: no reward in it
    wrong_shape.write_text("def verify(response, label, **kwargs):\n    return {'pred': response}\n")
    data = lambda name, rows: ["--data.train", jsonl(tmp / name, rows)]  # noqa: E731
    return [
        (["--data.train", str(tmp / "missing.jsonl")], [str(tmp / "missing.jsonl"), "no such file"]),
        (["--data.train", str(empty)], [str(empty), "empty"]),
        (data("no_prompt.jsonl", [good, {"label": "3"}]), ["no_prompt.jsonl", "line 2", "'prompt'", "missing"]),
        (data("no_label.jsonl", [good, {"prompt": "hi"}]), ["no_label.jsonl", "line 2", "'label'", "missing"]),
        (data("int_prompt.jsonl", [{"prompt": 5, "label": "1"}]), ["int_prompt.jsonl", "line 1", "'prompt'", "int"]),
        (["--data.train", str(latin1)], [str(latin1), "line 1", "not valid UTF-8", "0xe9"]),
        (["--actor.lrr", "1e-5"], ["unrecognized arguments: --actor.lrr", "did you mean --actor.lr?"]),
        (["--loss.kl_cov.ratio", "0"], ["--loss.kl_cov.ratio", "(0, 1]"]),
        (["--loss.clip_cov.ratio", "1.5"], ["--loss.clip_cov.ratio", "(0, 1]"]),
        (["--actor.lr", "-1e-5"], ["--actor.lr", "must be > 0"]),
        (["--actor.lr", "fast"], ["--actor.lr", "invalid float value: 'fast'"]),
        (["--async.max_staleness", "-1"], ["--async.max_staleness", "must be >= 0"]),
        (["--rollout.generate_timeout_s", "-5"], ["--rollout.generate_timeout_s", "must be > 0"]),
        (["--rollout.generate_timeout_s", "0"], ["--rollout.generate_timeout_s", "0 must be > 0"]),
        (["--preset", "huge"], ["--preset 'huge'", "unknown"]),
        (["--pretrain", str(tmp / "no_model")], ["--pretrain", "no_model", "no HF model"]),
        (["--pretrain", str(tmp / "not_there")], ["--pretrain", "not_there", "no such folder"]),
        (["--reward.verifier", f"{broken}:verify"], ["broken_verifier.py", "a_module_that_is_not_there"]),
        (["--reward.verifier", "nope.py:verify"], ["nope.py", "not found"]),
        (["--rollout.max_model_len", "40"], ["row 0", "--rollout.max_model_len 40"]),
        # the second of two test sets: named, not the first or the comma-joined flag
        (
            ["--data.test", f"{jsonl(tmp / 'test_a.jsonl', [good])},{tmp / 'test_b.jsonl'}"],
            [f"error: {tmp / 'test_b.jsonl'}: no such file"],
        ),
        (
            ["--data.test", f"{jsonl(tmp / 'test_a.jsonl', [good])},{jsonl(tmp / 'long.jsonl', [good, long])}"],
            ["long.jsonl: row 1", "--rollout.max_model_len 1024"],
        ),
        (["--actor.adam_betas", "0.9"], ["--actor.adam_betas", "two values in [0, 1)"]),
        (["--actor.weight_decay", "-1"], ["--actor.weight_decay", "-1.0 must be >= 0"]),
        (["--reward.timeout_s", "inf"], ["--reward.timeout_s", "inf must be > 0 and finite"]),
        (["--rollout.temperature", "inf"], ["--rollout.temperature", "inf must be > 0 and finite"]),
        (["--data.max_samples", "-1"], ["--data.max_samples", "-1 must be >= 0"]),
        (["--eval.max_samples", "-5"], ["--eval.max_samples", "-5 must be >= 0"]),
        (["--train.output_dir", jsonl(tmp / "a_file", [good])], ["--train.output_dir", "a_file", "cannot make"]),
        (["--pretrain", str(no_tokenizer)], ["--pretrain", "no_tokenizer", "its tokenizer does not load"]),
        (
            ["--data.test", jsonl(tmp / "verl_test.jsonl", [{"q": "hi", "answer": "4"}]), "--data.input_key", "q"],
            ["--data.test given without --data.train", "--data.input_key q"],
        ),
        (
            data("list_label.jsonl", [{"prompt": "hi", "label": ["4", "four"]}]),
            ["'label'", "one label per row", "list"],
        ),
        (
            ["--train.output_dir", str(tmp / "torn"), "--train.resume", "true"],
            ["--train.resume", "step2", "trainer_state.json does not read"],
        ),
        (
            ["--train.output_dir", str(tmp / "earlier")],
            ["--train.output_dir", "holds checkpoints of an earlier run (newest: step2)", "--train.resume true"],
        ),
        (["--algo.max_gen_batches", "0"], ["--algo.max_gen_batches", "0 must be >= 1"]),
        (["--ray.num_cpus", "-1"], ["--ray.num_cpus", "-1 must be >= 1"]),
        (["--logger.sample_table_every", "-1"], ["--logger.sample_table_every", "-1 must be >= 0"]),
        (
            ["--reward.verifier", f"{wrong_shape}:verify"],
            ["wrong_shape.py:verify", "first row of", "without 'reward' or 'score'", "every sample would fail"],
        ),
    ]


CASE_IDS = [
    "missing-dataset", "empty-dataset", "row-without-prompt", "row-without-label", "wrong-type", "non-utf8",
    "unknown-flag", "ratio-zero", "ratio-above-one", "negative-lr", "lr-not-a-number", "negative-staleness",
    "negative-generate-deadline", "zero-generate-deadline", "unknown-preset", "folder-without-model",
    "missing-model-folder",
    "verifier-import-error", "verifier-missing", "prompt-longer-than-context", "second-test-set-missing",
    "test-prompt-longer-than-context", "one-adam-beta", "negative-weight-decay", "infinite-verifier-deadline",
    "infinite-temperature", "negative-max-samples", "negative-eval-max-samples", "output-dir-is-a-file",
    "model-without-tokenizer", "test-keys-without-train", "list-label", "torn-checkpoint",
    "fresh-run-over-checkpoints", "no-generation-round", "negative-ray-cpus", "negative-table-interval",
    "verifier-result-without-reward",
]  # fmt: skip


def test_every_case_has_its_name(tmp_path):
    assert len(cases(tmp_path)) == len(CASE_IDS)


@pytest.mark.parametrize("case", range(len(CASE_IDS)), ids=CASE_IDS)
def test_bad_input_exits_2_with_one_line_naming_it(case, model, tmp_path, capsys, no_ray):
    flags, words = cases(tmp_path)[case]
    pretrain = [] if "--pretrain" in flags else ["--pretrain", model]
    base = ["--preset", "smoke", *pretrain, "--train.output_dir", str(tmp_path / "out")]
    code, err = run([*base, *flags], capsys)
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err  # one line, not a traceback or a usage dump
    for word in words:
        assert word in lines[0], lines[0]
    assert not (tmp_path / "out" / "wandb").exists()  # nothing was started


def test_a_relative_output_dir_inside_a_jobs_working_dir_copy_is_refused(model, tmp_path, capsys, no_ray, monkeypatch):
    """Under `ray job submit --working-dir .` the driver runs in Ray's unpacked copy, deleted with the session: a
    relative output folder would put the checkpoints and the final model there. Elsewhere it is fine."""
    copy = tmp_path / "session_x" / "runtime_resources" / "working_dir_files" / "_ray_pkg_0123"
    copy.mkdir(parents=True)
    monkeypatch.chdir(copy)
    code, err = run(["--preset", "smoke", "--pretrain", model, "--train.output_dir", "outputs/run"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "--train.output_dir 'outputs/run' is relative" in err and str(copy) in err and "absolute path" in err
    assert not (copy / "outputs").exists()
    # the same relative folder from a plain checkout passes this check (and stops at the next: a bad verifier)
    plain = tmp_path / "checkout"
    plain.mkdir()
    monkeypatch.chdir(plain)
    flags = ["--train.output_dir", "outputs/run", "--reward.verifier", "nope.py:f"]
    code, err = run(["--preset", "smoke", "--pretrain", model, *flags], capsys)
    assert code == 2 and "is relative" not in err and "nope.py" in err, err


def test_no_output_dir_inside_a_jobs_working_dir_copy_lands_under_home(model, tmp_path, capsys, no_ray, monkeypatch):
    """`ray job submit --working-dir . -- python pipelines/kl_cov.py --preset smoke` gives no output flag: the default
    must not be the refused relative folder, but one outside Ray's copy that outlives the job, said at start."""
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    copy = tmp_path / "session_x" / "runtime_resources" / "working_dir_files" / "_ray_pkg_0123"
    copy.mkdir(parents=True)
    monkeypatch.chdir(copy)
    code = main(["--preset", "smoke", "--pretrain", model, "--reward.verifier", "nope.py:f"], "kl_cov")
    printed = capsys.readouterr()
    assert code == 2 and "is relative" not in printed.err and "nope.py" in printed.err, printed.err
    assert f"output folder: {home}/entropy-openrlhf/outputs/run" in printed.out, printed.out
    assert not (copy / "outputs").exists()


def test_resolve_output_dir():
    from entropy_openrlhf.cluster import resolve_output_dir

    copy = "/tmp/ray/session_1/runtime_resources/working_dir_files/_ray_pkg_ab"
    home = os.path.expanduser("~")
    assert resolve_output_dir("", "/repo", "r") == "/repo/outputs/run"
    assert resolve_output_dir("", copy, "r") == f"{home}/entropy-openrlhf/outputs/run"
    assert resolve_output_dir("runs/a", "/repo", "r") == "/repo/runs/a"
    assert resolve_output_dir("/abs/b", copy, "r") == "/abs/b"
    with pytest.raises(ValueError, match="'runs/a' is relative.*--train.output_dir /shared/runs/r"):
        resolve_output_dir("runs/a", copy, "r")


def test_a_verifier_raising_on_its_label_as_a_response_is_noted_not_refused(model, tmp_path, capsys):
    """A verifier that parses a format the label is not in (an <answer> tag) raises on the probe's response: that
    may be the response's own fault, so the run is told, not stopped."""
    tagged = tmp_path / "tagged.py"
    tagged.write_text("import re\n\ndef verify(response, label, **kw):\n"
                      "    return float(re.search('<answer>(.*)</answer>', response).group(1) == label)\n")  # fmt: skip
    cfg = from_args(["--preset", "smoke", "--pretrain", model, "--train.output_dir", str(tmp_path / "out"),
                     "--reward.verifier", f"{tagged}:verify"])  # fmt: skip
    _, train_items, _ = prepare(cfg)
    out = capsys.readouterr().out
    assert train_items and "note: verifier" in out and "AttributeError" in out and "reward/errors" in out


def test_an_openrlhf_file_is_probed_with_the_query_a_run_gives_it(model, tmp_path, capsys):
    """The probe's query holds the special tokens, as in a run: a reward file that cuts the response at the
    end-of-turn token (and raises without one) passes it without a note."""
    cutting = tmp_path / "rm.py"
    cutting.write_text(
        "def reward_func(queries, prompts, labels):\n"  # str.index raises where the token is missing
        "    return [float(q.rsplit('assistant', 1)[1].index('<|im_end|>') > 0) for q in queries]\n"
    )
    cfg = from_args(["--preset", "smoke", "--pretrain", model, "--train.output_dir", str(tmp_path / "out"),
                     "--reward.verifier", str(cutting)])  # fmt: skip
    _, train_items, _ = prepare(cfg)
    assert train_items and "note: verifier" not in capsys.readouterr().out


def test_evaluate_script_names_a_missing_test_set_before_ray(model, tmp_path, capsys, no_ray):
    evaluate_main = runpy.run_path(str(ROOT / "scripts" / "evaluate.py"))["main"]
    missing = tmp_path / "aime.jsonl"
    code = evaluate_main(["--pretrain", model, "--data.test", str(missing), "--train.output_dir", str(tmp_path)])
    assert code == 2
    assert capsys.readouterr().err.strip() == f"error: {missing}: no such file or folder"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--preset", "smok"], "error: --preset 'smok': unknown; choose one of"),
        (["--eval.output_json", "/no/such/m.json"], "error: --eval.output_json /no/such/m.json: no folder /no/such"),
    ],
)
def test_evaluate_script_refuses_a_bad_preset_or_output_before_ray(flags, message, model, tmp_path, capsys, no_ray):
    evaluate_main = runpy.run_path(str(ROOT / "scripts" / "evaluate.py"))["main"]
    code = evaluate_main(["--pretrain", model, "--train.output_dir", str(tmp_path), *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(message) and "\n" not in err, err


def test_the_command_line_exits_2_and_starts_no_ray(tmp_path):
    """The same through `python pipelines/kl_cov.py`: exit code 2, one line, and no Ray session was created."""
    ray_tmp = tmp_path / "ray"
    ray_tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_JOB_ID")}
    env["RAY_TMPDIR"] = str(ray_tmp)
    missing = tmp_path / "missing.jsonl"
    proc = subprocess.run(
        [sys.executable, "pipelines/kl_cov.py", "--preset", "smoke", "--train.output_dir", str(tmp_path / "out"),
         "--data.train", str(missing)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {missing}: no such file or folder"], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert list(ray_tmp.iterdir()) == []  # Ray writes its session folder here the moment it starts
