"""scripts/gpu_check.py's CPU twin, as CI runs it: every check passes (and each is named), a value perturbed on
purpose fails its check and the run, and the script runs where Ray and vLLM cannot be imported at all (a GPU
machine without them)."""

import runpy
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]
SCRIPT = str(ROOT / "scripts" / "gpu_check.py")
EVERY_CPU_CHECK = ["forward", "objectives", "entropy", "zero2", "zero3", "head-chunk", "off-policy", "imports"]
# ray and vllm made unimportable (a None in sys.modules makes `import` raise), then the script run as __main__
WITHOUT_RAY = (
    "import runpy, sys; sys.modules['ray'] = sys.modules['vllm'] = None; sys.argv = sys.argv[1:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


def run(*flags: str, prefix: tuple[str, ...] = ()) -> tuple[int, list[str], str]:
    """Exit code, the summary's lines ("PASS  name  ..." / "FAIL  name  ...") and the whole output."""
    proc = subprocess.run([sys.executable, *prefix, SCRIPT, "--device", "cpu", *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    out = proc.stdout + proc.stderr
    summary = proc.stdout.split("[gpu-check] summary\n", 1)
    lines = [x for x in summary[1].splitlines() if x.startswith(("PASS", "FAIL"))] if len(summary) == 2 else []
    return proc.returncode, lines, out


def verdicts(lines: list[str]) -> dict[str, str]:
    return {line.split()[1]: line.split()[0] for line in lines}


@pytest.mark.timeout(900)
def test_every_check_of_the_cpu_twin_passes():
    code, lines, out = run()
    assert verdicts(lines) == dict.fromkeys(EVERY_CPU_CHECK, "PASS"), out[-6000:]
    assert code == 0
    # the lines carry their numbers: the learning rate followed its schedule inside DeepSpeed, packing was exact
    assert all("on schedule True" in x for x in lines if x.split()[1].startswith("zero"))
    assert "in 3 packed rows" in next(x for x in lines if x.split()[1] == "forward")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("planted", ["forward", "zero2", "head-chunk"])
def test_a_perturbed_value_fails_its_check_and_the_run(planted):
    # with a check that stays healthy beside it: the run reports both and exits 1
    code, lines, out = run("--only", f"entropy,{planted}", "--plant", planted)
    assert verdicts(lines) == {"entropy": "PASS", planted: "FAIL"}, out[-6000:]
    assert code == 1


@pytest.mark.timeout(600)
def test_the_check_runs_where_ray_and_vllm_cannot_be_imported():
    code, lines, out = run("--only", "objectives,zero2,imports", prefix=("-c", WITHOUT_RAY))
    assert verdicts(lines) == {"objectives": "PASS", "zero2": "PASS", "imports": "PASS"}, out[-6000:]
    assert code == 0


def test_the_script_offers_the_checks_the_module_runs():
    from entropy_openrlhf.gpu_check import CHECKS

    assert runpy.run_path(SCRIPT)["CHECKS"] == CHECKS  # run_path defines the script's names; main() does not run
