#!/usr/bin/env python
"""The one-GPU check: run it first on a new GPU machine, before scripts/gpu_preflight.sh. No Ray, no vLLM, one
device, a few minutes. It prints one PASS or FAIL line per check (entropy_openrlhf/gpu_check.py says what each
compares, with what tolerance) and exits 1 when one fails, 0 when all pass.

    python scripts/gpu_check.py                         # cuda:0, a tiny random model, bf16 against fp32
    python scripts/gpu_check.py --model smollm2         # SmolLM2-135M-Instruct (the GGUF the package ships)
    python scripts/gpu_check.py --device cpu            # its CPU twin (fp32 against fp64), which CI runs

`--plant CHECK` perturbs the value one check compares, so that it must fail (tests/integration/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# the module's CHECKS, named here so that --help and a bad flag need no DeepSpeed import (a test keeps them equal)
CHECKS = ("cuda", "forward", "objectives", "entropy", "zero2", "zero3", "head-chunk", "off-policy", "imports")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where the checks run (default cuda)")
    p.add_argument("--model", default="tiny", help="tiny (default, fastest) | smollm2 | an HF model folder")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="the working dtype: auto = bf16 on cuda, fp32 on cpu (bf16 is ~60x slower on CPUs without "
                        "AMX); each is compared with one precision wider")  # fmt: skip
    p.add_argument("--only", default="", help=f"comma-separated checks to run (default all): {', '.join(CHECKS)}")
    p.add_argument("--plant", default="", choices=("", *CHECKS[1:-1]), help="perturb this check's value (tests)")
    args = p.parse_args(argv)
    args.only = [c for c in args.only.split(",") if c]
    unknown = [c for c in args.only if c not in CHECKS]
    if unknown:
        p.error(f"--only: unknown check(s) {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    return args


def use_device(device: str) -> None:
    """The environment DeepSpeed and transformers read when imported: DeepSpeed's accelerator, and on the CPU no
    GPU at all, so that nothing lands on one (set before the checks' module is imported, below)."""
    os.environ["DS_ACCELERATOR"] = device
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every model here is local


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    use_device(args.device)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("FAIL  cuda        no CUDA device visible to torch (--device cpu runs the CPU twin)", flush=True)
        return 1
    # after use_device: DeepSpeed picks its accelerator when imported (the module's docstring)
    from entropy_openrlhf.gpu_check import run_checks

    checks = run_checks(args.device, args.model, args.dtype, args.only, args.plant)
    print("[gpu-check] summary", flush=True)
    for check in checks:
        print(check.line(), flush=True)
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
