"""Fit R = -a exp(H) + b to a run's (entropy, accuracy) pairs, report a, b, the ceiling b - a and RMSE, optionally
forecast the rest of the run from its first points, and write a PNG plot.

    python scripts/fit_entropy_law.py runs.csv --entropy entropy/seq_mean --acc eval/acc --plot fit.png
    python scripts/fit_entropy_law.py outputs/run --forecast-from 10   # a run's output folder (its metrics.jsonl)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from entropy_openrlhf.algorithms.entropy_law import fit_entropy_law, forecast, plot_fit, read_csv, read_wandb_offline


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="a CSV file, or a run's output folder (it holds metrics.jsonl)")
    p.add_argument("--entropy", default="entropy/seq_mean", help="entropy column / metric name")
    p.add_argument("--acc", default="eval/acc", help="accuracy column / metric name")
    p.add_argument("--forecast-from", type=int, default=0, help="fit on the first N points and predict the rest")
    p.add_argument("--plot", default="", help="write a PNG of the fit here")
    args = p.parse_args(argv)

    src = Path(args.source)
    if not src.exists():
        p.error(f"{src}: no such file or folder")
    try:
        if src.is_dir():
            h, r = read_wandb_offline(src, args.entropy, args.acc)
        else:
            h, r = read_csv(src, args.entropy, args.acc)
        law = fit_entropy_law(h, r)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"points: {law.n_points}")
    print(f"a: {law.a:.6g}")
    print(f"b: {law.b:.6g}")
    print(f"ceiling (b - a): {law.ceiling:.6g}")
    print(f"rmse: {law.rmse:.6g}")
    if args.forecast_from:
        try:
            fc = forecast(h, r, args.forecast_from)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(
            f"forecast from first {args.forecast_from} points: rmse {fc['forecast_rmse']:.6g}, "
            f"final predicted {fc['final_predicted']:.4g} vs actual {fc['final_actual']:.4g}"
        )
    if args.plot:
        plot_fit(h, r, law, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
