"""The one-device check (scripts/gpu_check.py): the trainer's numerics and its DeepSpeed step on one GPU, without
Ray or vLLM, in a few minutes. Each check prints one PASS or FAIL line with its numbers:

- forward: the policy's log-prob forward (actors/forward.py) in the working dtype, plain and with shared-prefix
  packing, against each other and against the same model one precision wider, where packing must be exact;
- objectives: every registered objective's loss, gradient and selection on the device against the CPU's;
- entropy: the chunked token entropy and the entropy bonus's gradient on the device against fp64 formulas;
- zero2, zero3: DeepSpeed ZeRO-2 and ZeRO-3 optimizer steps of the policy on a fixed batch, through the engine
  builder (actors/policy_engine.py) and the step's phases (actors/train_phases.py) that a policy rank runs, on a
  one-rank process group: finite, applied, the batch's policy loss lower, the learning rate on its schedule;
- head-chunk: the output head in chunks of response tokens (`--train.head_chunk_tokens`) against whole, under
  ZeRO-3: the same log-probs, the same first optimizer step, the same loss after it;
- off-policy: every preset of algorithms/off_policy.py `correct` on the device against the CPU's;
- imports: neither Ray nor vLLM was imported.

The working dtype is bf16 on a GPU and fp32 on the CPU (bf16 matmuls are ~60x slower on CPUs without AMX:
models/dtype.py); "one precision wider" is fp32 for bf16 and fp64 for fp32, so the CPU twin (`--device cpu`, run by
tests/integration/test_gpu_check.py) compares something too. The objectives and `correct` compute in fp32 whatever
their inputs' dtype (loss_terms.prepare), so their reference is the CPU's fp32 from the same numbers held in fp64:
on a GPU the lines compare CUDA's kernels (reductions, sorts, top-k) with the CPU's; on the CPU twin both sides are
one computation and agree exactly. The tolerances are `TOLERANCES`, per working dtype.

Import this module only after the device's environment is set (scripts/gpu_check.py does): DeepSpeed picks its
accelerator from DS_ACCELERATOR when it is imported, as on a policy rank (policy_actor.py's docstring).
"""

from __future__ import annotations

import gc
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import deepspeed
import torch
import transformers

from entropy_openrlhf.gpu_check.common import CHECKS, DTYPE_NAMES, WIDER, Check, Context
from entropy_openrlhf.gpu_check.numerics import (
    check_cuda,
    check_entropy,
    check_forward,
    check_imports,
    check_objectives,
    check_off_policy,
)
from entropy_openrlhf.gpu_check.zero import check_head_chunk, check_zero, start_process_group
from entropy_openrlhf.models.smollm2 import ensure_smollm2
from entropy_openrlhf.models.tiny import make_tiny_model

__all__ = ["CHECKS", "run_checks"]


def model_path(name: str, workdir: Path) -> str:
    """tiny (a random 2-layer Llama made here), smollm2 (the package's GGUF, converted once) or an HF folder."""
    if name == "tiny":
        return str(make_tiny_model(workdir / "tiny"))
    if name == "smollm2":
        return ensure_smollm2()
    if not (Path(name) / "config.json").is_file():
        raise FileNotFoundError(f"--model {name}: tiny, smollm2 or an HF model folder")
    return name


def run_checks(device: str, model: str, dtype: str, only: list[str], plant: str) -> list[Check]:
    """Run the checks `only` names (all by default) and print each line as it finishes."""
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    work_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(dtype) or (
        torch.bfloat16 if dev.type == "cuda" else torch.float32
    )
    selected = [c for c in CHECKS if (not only or c in only) and (c != "cuda" or dev.type == "cuda")]
    checks: list[Check] = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        path = model_path(model, Path(tmp))
        ctx = Context(dev, work_dtype, path, model, plant)
        print(f"[gpu-check] {dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'CPU'}), model "
              f"{model} ({path}), {DTYPE_NAMES[work_dtype]} against {DTYPE_NAMES[WIDER[work_dtype]]}; torch "
              f"{torch.__version__}, deepspeed {deepspeed.__version__}, transformers {transformers.__version__}",
              flush=True)  # fmt: skip
        if any(c.startswith("zero") or c == "head-chunk" for c in selected):
            start_process_group(dev)
        runners: dict[str, Callable[[], Check]] = {
            "cuda": lambda: check_cuda(ctx),
            "forward": lambda: check_forward(ctx),
            "objectives": lambda: check_objectives(ctx),
            "entropy": lambda: check_entropy(ctx),
            "zero2": lambda: check_zero(ctx, 2),
            "zero3": lambda: check_zero(ctx, 3),
            "head-chunk": lambda: check_head_chunk(
                ctx
            ),  # last of the engines: its HfDeepSpeedConfig must not outlive it
            "off-policy": lambda: check_off_policy(ctx),
            "imports": lambda: check_imports(ctx),
        }
        for name in selected:
            t0 = time.time()
            try:
                check = runners[name]()
            except Exception as e:  # noqa: BLE001 - a check that raises is a FAIL line, and the others still run
                traceback.print_exc()
                check = Check(name, False, f"raised {type(e).__name__}: {e}")
            check.seconds = time.time() - t0
            print(check.line(), flush=True)
            checks.append(check)
            gc.collect()  # the check's models and engines, before the next one loads its own
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # NCCL warns at exit about a group left up
    return checks
