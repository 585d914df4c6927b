"""The README is for users (<= 300 lines) and docs/ holds the rest: every section the README had before it was cut
down has a home in docs/ (listed here, checked as a heading), every relative link of README and docs resolves
(file and heading), and the README's two Development commands are what CI runs."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"

# The README's sections before it became a user README (wave 3, #33): each must stay a heading in docs/.
MOVED = {
    "Quick start (fresh machine: Python 3.11, pip, gcc)": "development.md",
    "On GPUs and several machines: run the doctor first": "doctor.md",
    "The nodes": "nodes.md",
    "In the ComfyUI frontend": "nodes.md",
    "What the workers run: ComfyUI's own model": "how-it-works.md",
    "What runs in parallel, per family": "how-it-works.md",
    "Parallel config and device mesh": "how-it-works.md",
    "DistriFusion and PipeFusion (stale K/V methods)": "methods.md",
    "Step caching across ranks (EasyCache)": "methods.md",
    "Weight sharding (models larger than one device)": "methods.md",
    "Patch-parallel VAE decode": "methods.md",
    "The demo model": "demo-model.md",
    "Quality of the stale methods and of step caching, on the demo model": "demo-model.md",
    "Worker pool": "worker-pool.md",
    "Performance": "performance.md",
    "Benchmarks": "performance.md",
    "Tests": "development.md",
    "Layout": "development.md",
}


def _headings(path: Path) -> list:
    out, fence = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"^#{1,6} ", line):
            out.append(line.lstrip("#").strip())
    return out


def _slug(heading: str) -> str:  # GitHub's anchors
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_is_short_and_for_users():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    for section in ("Requirements", "Install", "First generation", "Which setting for my GPUs", "The nodes",
                    "Memory", "Troubleshooting", "Development"):
        assert section in _headings(REPO / "README.md"), section
    assert "not yet run on real GPUs" in text  # the status says what ran on GPUs and what did not


def test_every_moved_section_has_a_home_in_docs():
    for heading, home in MOVED.items():
        assert heading in _headings(DOCS / home), f"{heading!r} is not a heading of docs/{home}"


def test_every_relative_link_resolves():
    files = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
    for f in files:
        text = re.sub(r"```.*?```", "", f.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^(https?:|mailto:)", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (f.parent / path).resolve() if path else f
            assert dest.exists(), f"{f.name}: link to missing {target}"
            if anchor and dest.suffix == ".md":
                assert anchor in {_slug(h) for h in _headings(dest)}, f"{f.name}: no heading #{anchor} in {dest.name}"


def test_the_two_development_commands_are_what_ci_runs():
    readme = (REPO / "README.md").read_text()
    dev = readme.split("## Development", 1)[1]
    assert "bash scripts/main_job.sh" in dev and "bash scripts/test.sh" in dev
    assert "scripts/test.sh" in (REPO / ".ci" / "run").read_text()


def test_works_with_page_is_what_the_table_says():
    """docs/works-with.md is written from workers/bridge/classified.py (scripts/make_works_with.py): run that script
    after changing the table."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("make_works_with", REPO / "scripts" / "make_works_with.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (DOCS / "works-with.md").read_text() == module.render(), "run: python scripts/make_works_with.py"
