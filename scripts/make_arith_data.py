"""Write the built-in arithmetic word problems as train/test jsonl (the loader's native schema).

python scripts/make_arith_data.py --out-dir data/arith --n-train 2000 --n-test 300 --seed 0 --levels 1,2,3
python pipelines/kl_cov.py --data.train data/arith/arith_train.jsonl --data.test data/arith/arith_test.jsonl
"""

from __future__ import annotations

import argparse
import sys

from entropy_openrlhf.data.arith_task import DEFAULT_LEVELS, LEVELS, write_builtin_task


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True, help="folder for arith_train.jsonl and arith_test.jsonl")
    p.add_argument("--n-train", type=int, default=2000, help="training rows")
    p.add_argument("--n-test", type=int, default=300, help="test rows")
    p.add_argument("--seed", type=int, default=0, help="same seed, same files")
    p.add_argument(
        "--levels",
        default=",".join(map(str, DEFAULT_LEVELS)),
        help=f"comma-separated levels out of {','.join(map(str, LEVELS))}, in equal shares",
    )
    args = p.parse_args(argv)
    try:
        levels = tuple(int(x) for x in args.levels.split(","))
    except ValueError:
        p.error(f"--levels {args.levels}: expected comma-separated integers such as 1,2,3")
    if not set(levels) <= set(LEVELS):
        p.error(f"--levels {args.levels}: levels are {','.join(map(str, LEVELS))}")
    if args.n_train < 0 or args.n_test < 0:
        p.error("--n-train and --n-test must be >= 0")
    train, test = write_builtin_task(
        args.out_dir, seed=args.seed, n_train=args.n_train, n_test=args.n_test, levels=levels
    )
    print(f"wrote {args.n_train} rows to {train} and {args.n_test} rows to {test}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
