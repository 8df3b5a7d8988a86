"""The methods documentation lives in the repository and every link into it resolves (issue 26)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_into_the_methods_docs_names_a_section_that_exists():
    methods = (ROOT / "docs" / "methods.md").read_text(encoding="utf-8")
    anchors = {_anchor(line.lstrip("#")) for line in methods.splitlines() if line.startswith("#")}
    sources = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "src").rglob("*.py")),
               *sorted((ROOT / "src").rglob("*.j2"))]
    links = [(path.name, anchor) for path in sources for anchor in re.findall(r"docs/methods\.md#([A-Za-z0-9_-]+)", path.read_text(encoding="utf-8"))]
    assert len(links) > 20
    assert [link for link in links if link[1] not in anchors] == []
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "METHODS.md" not in readme and "docs/methods.md" in readme  # the repository's own docs, not a file it lacks


def test_the_readme_says_how_to_put_bertology_on_the_path():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "source .venv/bin/activate" in readme and ".venv/bin/bertology" in readme
