"""Tuned against hand-picked, per spec and M bucket, from two ``bench.csv`` files of one run.

    python scripts/compare_bench.py HANDPICKED/bench.csv TUNED/bench.csv

Prints a markdown table of the bucket geomean times (us) and the tuned speed-up, and
refuses rows whose check did not pass (a WRONG or ERROR point is never compared).
"""

import csv
import math
import sys

from tvm_rmsquant.schedules.database import ROW_BUCKETS, bucket_score


def read(path):
    times = {}
    with open(path) as handle:
        for row in csv.DictReader(handle):
            if row["agreement"].startswith(("WRONG", "ERROR")):
                raise SystemExit(f"{path}: {row['spec']} M={row['rows']} failed its check: {row['agreement']}")
            times.setdefault(row["spec"], {})[int(row["rows"])] = float(row["microseconds"])
    return times


def main(handpicked_csv, tuned_csv):
    handpicked, tuned = read(handpicked_csv), read(tuned_csv)
    print("| spec | M bucket | hand-picked µs | tuned µs | tuned speed-up |")
    print("|---|---|---:|---:|---:|")
    ratios = []
    for spec in sorted(handpicked):
        for max_rows, _ in ROW_BUCKETS:
            before, after = bucket_score(handpicked[spec], max_rows), bucket_score(tuned.get(spec, {}), max_rows)
            if math.isnan(before) or math.isnan(after):
                continue
            ratios.append(before / after)
            bucket = f"≤{max_rows}" if max_rows else f">{ROW_BUCKETS[-2][0]}"
            print(f"| {spec} | {bucket} | {before:.2f} | {after:.2f} | {before / after:.3f}× |")
    print(f"\n{len(ratios)} (spec, bucket) pairs: speed-up min {min(ratios):.3f}×, geomean "
          f"{math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}×, max {max(ratios):.3f}×")


if __name__ == "__main__":
    main(*sys.argv[1:3])
