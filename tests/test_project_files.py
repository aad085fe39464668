"""The project's basics: a license, a citation file that names every paper the README references, and the
requirements files in one folder."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def test_license_is_apache_2():
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert yaml.safe_load((REPO / "CITATION.cff").read_text())["license"] == "Apache-2.0"


def test_citation_names_every_paper_of_the_readme_references():
    cff = yaml.safe_load((REPO / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0" and cff["title"] and cff["authors"]
    cited = {i["value"].removeprefix("arXiv:") for r in cff["references"] for i in r.get("identifiers", [])}
    references = (REPO / "README.md").read_text().split("## References", 1)[1]
    in_readme = set(re.findall(r"arXiv (\d{4}\.\d{4,5})", references))
    assert in_readme and in_readme <= cited, sorted(in_readme - cited)
    # every arXiv paper the README cites anywhere is in its references
    assert set(re.findall(r"arXiv (\d{4}\.\d{4,5})", (REPO / "README.md").read_text())) <= in_readme


def test_requirements_files_live_in_one_folder():
    assert not list(REPO.glob("requirements*.txt")) and not (REPO / "constraints.txt").exists()
    assert {"cpu.txt", "constraints.txt", "gpu.txt"} <= {p.name for p in (REPO / "requirements").glob("*.txt")}


# How the GPU checks were run while the repository was developed is not a user's business: user docs name
# commands a user with a GPU runs.
DEVELOPMENT_TOOLING = re.compile(r"device tool|device call|\blent\b|`carry|carry: \[|timeout_s|files_at|"
                                 r"nvidia-h100-x1|budget_left|give the machine back", re.I)


def test_user_docs_do_not_describe_the_development_tooling():
    docs = [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "experiments").glob("*/README.md"),
            REPO / "analysis" / "README.md", REPO / "docker" / "APPTAINER.md"]
    hits = [f"{p.relative_to(REPO)}:{i}: {line.strip()[:80]}" for p in docs if p.exists()
            for i, line in enumerate(p.read_text().splitlines(), 1) if DEVELOPMENT_TOOLING.search(line)]
    assert hits == []
