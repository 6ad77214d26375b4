"""Bring a GPU suite run's rows home: append the CSVs a device call returned to benchmarks/results/.

The lent machine writes its CSVs under `$OUT`; the device tool copies them back read-only (its `files_at` folder),
and only the latest command's files can be fetched, so collect after every call. Rows are appended unchanged
(same columns, `harness.append_rows`'s header check); a file the results folder does not have yet is created.
`suite.log` is copied as `results/gpu_suite_<git sha>_<UTC time>.log` next to them; a GPU run's tuned-tile table
(part b, `tuned/<device>.json`) goes to kernels/tuned/, where the kernels read it.

    python -m benchmarks.gpu.collect /work/.device/<call>/files     # after each device call (PLAN.md)

Must not: measure, or edit rows. Test: tests/integration/test_gpu_suite.py (collects the CPU smoke's folder).
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.harness import CSV_COLUMNS, RESULTS_DIR, read_rows
from kernels.tuned_tiles import TUNED_DIR


def collect(returned: Path, results_dir: Path = RESULTS_DIR, tuned_dir: Path | None = None) -> dict[str, int]:
    """Append every `*.csv` under `returned` (searched recursively) to the same-named file in `results_dir`.

    Args:
        returned: the folder the device call's files came back to.
        results_dir: the checked-in results folder.
        tuned_dir: where a GPU run's tuned-tile tables (`tuned/*.json`, source mode "gpu") are copied, replacing
            the device's table (kernels/tuned/ from the command line); None = not copied.

    Returns:
        {csv name: rows appended}.
    """
    counts = {}
    results_dir.mkdir(parents=True, exist_ok=True)
    for path in sorted(returned.rglob("*.csv")):
        rows = read_rows(path)  # refuses a file whose header is not the harness's columns
        target = results_dir / path.name
        read_rows(target)  # the same check on the file we append to
        is_new = not target.exists() or target.stat().st_size == 0
        with target.open("a", newline="") as f:
            writer = csv.writer(f, lineterminator="\n")
            if is_new:
                writer.writerow(CSV_COLUMNS)
            writer.writerows([row[c] for c in CSV_COLUMNS] for row in rows)
        counts[path.name] = len(rows)
    for table in sorted(returned.rglob("tuned/*.json")) if tuned_dir is not None else ():
        if json.loads(table.read_text()).get("source", {}).get("mode") == "gpu":
            tuned_dir.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(table, tuned_dir / table.name)
            print(f"tuned-tile table -> {tuned_dir / table.name}")
    for log in returned.rglob("suite.log"):
        sha = next((r["git_sha"] for r in read_rows(log.parent / "suite.csv")), "nosha") \
            if (log.parent / "suite.csv").exists() else "nosha"
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        shutil.copyfile(log, results_dir / f"gpu_suite_{sha or 'nosha'}_{stamp}.log")
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("returned", type=Path, help="the folder a device call's $OUT files came back to")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--tuned-dir", type=Path, default=TUNED_DIR, help="where GPU tuned-tile tables go")
    args = parser.parse_args(argv)
    counts = collect(args.returned, args.results_dir, args.tuned_dir)
    for name, n in counts.items():
        print(f"{n:5d} rows -> {args.results_dir / name}")
    if not counts:
        print(f"no CSV under {args.returned}")


if __name__ == "__main__":
    main()
