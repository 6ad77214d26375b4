"""Redraw benchmark figures from the results CSVs; the CSV is the record, the PNGs are derived and never hand-edited.

Owns: one PNG per (bench, metric) in `benchmarks/results/plots/<bench>_<metric>.png`, one line per
(variant, mode, device) with x = `x_value`, y = `p50` and a shaded p20-p80 band. Rows that differ only in
`config_json` (say float32 and bfloat16) are drawn as separate lines labelled with their config. When a key was
measured more than once (rows appended without `--overwrite`), the last row in the file wins.

Must not: measure anything or modify a CSV. Draws with matplotlib's Agg canvas directly (no pyplot, so importing
this module changes no global backend).

    python -m benchmarks.plot                          # every benchmarks/results/*.csv
    python -m benchmarks.plot benchmarks/results/gemm.csv
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import NullLocator

from benchmarks.harness import KEY_COLUMNS, RESULTS_DIR, read_rows

# A numeric x axis spanning at least this ratio (max / min, all > 0) is drawn on a log scale; same for y.
LOG_SCALE_RATIO = 16
# Up to this many distinct numeric x values, each measured x gets its own tick label.
MAX_LABELLED_X = 12


def redraw(csv_path: Path | str, out_dir: Path | str | None = None) -> list[Path]:
    """Draw every (bench, metric) of one results CSV to its PNG, replacing older figures of the same name.

    Args:
        csv_path: a CSV written by `benchmarks.harness.append_rows`.
        out_dir: where PNGs go; default `<csv folder>/plots`.

    Returns:
        The PNG paths written, sorted ([] for an empty CSV).
    """
    csv_path = Path(csv_path)
    out_dir = Path(out_dir) if out_dir is not None else csv_path.parent / "plots"
    latest: dict[tuple[str, ...], dict[str, str]] = {}
    for row in read_rows(csv_path):
        latest[tuple(row[c] for c in KEY_COLUMNS)] = row
    figures: dict[tuple[str, str], list[dict[str, str]]] = defaultdict(list)
    for row in latest.values():
        figures[(row["bench"], row["metric"])].append(row)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for (bench, metric), rows in sorted(figures.items()):
        path = out_dir / f"{_file_safe(bench)}_{_file_safe(metric)}.png"
        _draw(rows, f"{bench}: {metric}", path, source=csv_path.name)
        written.append(path)
    return written


def _draw(rows: list[dict[str, str]], title: str, path: Path, source: str) -> None:
    """One figure: a p50 line and p20-p80 band per (variant, mode, device, config)."""
    lines: dict[tuple[str, str, str, str], list[dict[str, str]]] = defaultdict(list)
    for row in rows:
        lines[(row["variant"], row["mode"], row["device"], row["config_json"])].append(row)
    show_config = len({key[3] for key in lines}) > 1
    is_numeric = all(_is_number(row["x_value"]) for row in rows)
    categories = sorted({row["x_value"] for row in rows}) if not is_numeric else []

    fig = Figure(figsize=(7.5, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for (variant, mode, device, config_json), points in sorted(lines.items()):
        if is_numeric:
            points.sort(key=lambda r: float(r["x_value"]))
            xs = [float(r["x_value"]) for r in points]
        else:
            points.sort(key=lambda r: categories.index(r["x_value"]))
            xs = [categories.index(r["x_value"]) for r in points]
        p20, p50, p80 = ([float(r[q]) for r in points] for q in ("p20", "p50", "p80"))
        label = f"{variant} / {mode} / {device}"
        if show_config:
            label += f" [{_short_config(config_json)}]"
        (line,) = ax.plot(xs, p50, marker="o", label=label)
        ax.fill_between(xs, p20, p80, color=line.get_color(), alpha=0.2, linewidth=0)

    xs_all = sorted({float(r["x_value"]) for r in rows}) if is_numeric else []
    if _spans(xs_all):
        ax.set_xscale("log", base=2)
    if not is_numeric:
        ax.set_xticks(range(len(categories)), categories)
    elif len(xs_all) <= MAX_LABELLED_X:
        ax.set_xticks(xs_all, [f"{x:g}" for x in xs_all])
        ax.xaxis.set_minor_locator(NullLocator())
    if _spans([float(r[q]) for r in rows for q in ("p20", "p80")]):
        ax.set_yscale("log")
    first = rows[0]
    ax.set_title(title)
    ax.set_xlabel(first["x_name"])
    ax.set_ylabel(f"{first['metric']} ({first['unit']})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    shas = sorted({r["git_sha"] or "?" for r in rows})
    fig.text(0.01, 0.01, f"p50 line, p20-p80 band; {source}; git {', '.join(shas)}", fontsize=7, alpha=0.7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path)


def _is_number(text: str) -> bool:
    """True when the cell parses as a float."""
    try:
        float(text)
    except ValueError:
        return False
    return True


def _spans(values: list[float]) -> bool:
    """True for positive values whose max/min reaches LOG_SCALE_RATIO."""
    return bool(values) and min(values) > 0 and max(values) / min(values) >= LOG_SCALE_RATIO


def _short_config(config_json: str) -> str:
    """`{"dtype":"float32"}` -> `dtype=float32`."""
    try:
        config = json.loads(config_json)
    except json.JSONDecodeError:
        return config_json
    if not isinstance(config, dict):
        return config_json
    return ", ".join(f"{k}={v}" for k, v in config.items())


def _file_safe(name: str) -> str:
    """Letters, digits, '-', '_' and '.' kept; anything else becomes '_'."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def main(argv: list[str] | None = None) -> None:
    """Command line: redraw the given CSVs, or every CSV in benchmarks/results/."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="*", type=Path, help="results CSVs (default: benchmarks/results/*.csv)")
    args = parser.parse_args(argv)
    for csv_path in args.csv or sorted(RESULTS_DIR.glob("*.csv")):
        for png in redraw(csv_path):
            print(png)


if __name__ == "__main__":
    main()
