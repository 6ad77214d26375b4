"""The results pages cannot drift from the rows: docs/performance.md and the README's headline table equal a fresh
rendering of benchmarks/results/*.csv (benchmarks/results_page.py), and every results CSV has its section.

After appending rows: `python -m benchmarks.results_page`, then commit the CSV and the pages together.
"""

from benchmarks import results_page
from benchmarks.harness import RESULTS_DIR


def test_performance_page_and_readme_headline_equal_a_fresh_rendering():
    stale = results_page.stale()
    assert not stale, f"stale against benchmarks/results/*.csv: {stale}; run `python -m benchmarks.results_page`"


def test_every_results_csv_has_a_section_and_a_command():
    page = results_page.PAGE.read_text()
    for csv in sorted(RESULTS_DIR.glob("*.csv")):
        assert csv.stem in results_page.COMMANDS, f"{csv.name}: no command in benchmarks/results_page.py COMMANDS"
        assert f"{{#{csv.stem.replace('_', '-')}}}" in page, f"{csv.name}: no section in docs/performance.md"


def test_each_headline_names_device_commit_date_repeats_spread_and_command():
    for headline in results_page.HEADLINES:
        row = results_page.headline_row(headline)
        for key in ("device", "commit", "date", "repeats", "spread", "command"):
            assert row[key], f"{headline.title}: no {key}"


def test_headline_plots_exist_for_every_plotted_csv():
    for stem in results_page.PLOTTED:
        assert list(results_page.PLOTS_DIR.glob(f"{stem}_*.png")), f"no docs/plots/{stem}_*.png: re-render the pages"
