"""Every command the documentation shows names a file that exists and only options its script defines.

The READMEs, docs/ and results/ show commands a newcomer copies; a renamed script or option turns one
into an error on first use. This reads them as text (nothing runs): each ``python <script>.py ...``,
``bash <script>.sh`` and ``./<path>/launch.sh`` must name a file of the repository, and each ``--option``
of a Python script must appear in that script's source."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("experiments/*/README.md"),
               ROOT / "analysis" / "README.md", *ROOT.glob("results/*.md")])
PYTHON = r"(?:python3?|\.venv[\w-]*/bin/python|\$PY(?:THON)?)"
SCRIPT = re.compile(PYTHON + r"\s+((?:scripts|benchmarks|experiments)/[\w/.-]+\.py)([^`\n|]*)")
SHELL = re.compile(r"(?:bash\s+|\./)((?:scripts|experiments|benchmarks|\.ci)/[\w/.-]+\.(?:sh|sbatch)|\.ci/run)")
OPTION = re.compile(r"(?<![\w-])(--[a-zA-Z][\w-]*)")


def commands() -> list[tuple[str, str, str, str]]:
    """(document, kind, path, the rest of the command up to its end or the next one)."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        name = str(doc.relative_to(ROOT))
        for m in SCRIPT.finditer(text):
            out.append((name, "script", m.group(1), re.split(r"&&|;|\|", m.group(2))[0]))
        out += [(name, "shell", m.group(1), "") for m in SHELL.finditer(text)]
    return out


def test_the_documentation_shows_commands():
    kinds = {kind for _, kind, _, _ in commands()}
    assert {"script", "shell"} <= kinds and len(commands()) > 50


@pytest.mark.parametrize("doc", [str(d.relative_to(ROOT)) for d in DOCS])
def test_every_documented_command_names_what_exists(doc):
    wrong = []
    for name, kind, target, rest in commands():
        if name != doc:
            continue
        path = ROOT / target
        if not path.exists():
            wrong.append(f"{target}: no such file")
            continue
        if kind == "script":
            source = path.read_text()
            if "add_output_args(" in source:  # a benchmark's --out / --record come from moerl.bench_output
                source += (ROOT / "src" / "moerl" / "bench_output.py").read_text()
            wrong += [f"{target} {option}: not an option of the script" for option in OPTION.findall(rest)
                      if f'"{option}"' not in source and f"'{option}'" not in source]
    assert not wrong, f"{doc}: " + "; ".join(sorted(set(wrong)))


# A path of the repository's own code or docs, as the documentation quotes it in backticks.
QUOTED_PATH = re.compile(r"`((?:src|scripts|experiments|tests|benchmarks|analysis|docs)/[\w/.+-]+)")
# Paths that are not this repository's: verl's own documentation, cited as the source of a formula or
# setting.
UPSTREAM_PATHS = {"docs/algo/rollout_corr_math.md", "docs/advance/ppo_lora.rst"}


@pytest.mark.parametrize("doc", [str(d.relative_to(ROOT)) for d in DOCS])
def test_every_quoted_repository_path_exists(doc):
    """A module, script or folder the prose names in backticks exists, so a reader who follows it (or a
    module that was moved) does not land on nothing. Placeholders (``experiments/NN``) are skipped."""
    text = (ROOT / doc).read_text()
    quoted = {m.group(1).rstrip(".") for m in QUOTED_PATH.finditer(text)}
    missing = sorted(p for p in quoted - UPSTREAM_PATHS
                     if "NN" not in p and not (ROOT / p).exists() and not (ROOT / p.rstrip("/")).exists())
    assert not missing, f"{doc}: quoted paths that do not exist: {missing}"


# A repository path named anywhere in the code's comments and docstrings (outside the tests, whose
# fixtures name made-up paths on purpose).
CODE = sorted(p for pattern in ("src/**/*.py", "scripts/*", "experiments/**/*", "benchmarks/*.py", "analysis/*.ipynb")
              for p in ROOT.glob(pattern) if p.is_file() and p.suffix in (".py", ".sh", ".yaml", ".ipynb", ".sbatch"))
NAMED_PATH = re.compile(r"(?<![\w/.$-])((?:src|scripts|experiments|benchmarks|analysis|docs)/[\w/.+-]*\w)(?!\{)")


def test_every_path_the_code_names_exists():
    """A comment or docstring that points at a moved or renamed file sends its reader nowhere."""
    assert len(CODE) > 100
    missing = []
    for path in CODE:
        for m in NAMED_PATH.finditer(path.read_text()):
            name = m.group(1)
            if any(mark in name for mark in ("NN", "NAME")) or name in UPSTREAM_PATHS:
                continue  # a placeholder or another project's file
            if not (ROOT / name).exists():
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, "paths that do not exist: " + "; ".join(missing)


# A section a document points the reader to by its heading: (`docs/x.md`, "Heading"), section "Heading"
# (in the same document) or the README's "Heading" section (the front page).
SECTION_IN_FILE = re.compile(r"`([\w./-]+\.md)`,? \"([^\"]+)\"")
SECTION_HERE = re.compile(r"section \"([^\"]+)\"")
SECTION_FRONT = re.compile(r"README's \"([^\"]+)\" section")


def _headings(path: Path) -> list[str]:
    return [line.lstrip("#").strip().lower() for line in path.read_text().splitlines() if line.startswith("#")]


def section_references(doc: Path) -> list[tuple[Path, str]]:
    text = doc.read_text()
    refs = [(doc, m.group(1)) for m in SECTION_HERE.finditer(text)]
    refs += [(ROOT / "README.md", m.group(1)) for m in SECTION_FRONT.finditer(text)]
    for m in SECTION_IN_FILE.finditer(text):
        near, from_root = (doc.parent / m.group(1)).resolve(), ROOT / m.group(1)
        refs.append((near if near.exists() else from_root, m.group(2)))
    return refs


@pytest.mark.parametrize("doc", [str(d.relative_to(ROOT)) for d in DOCS])
def test_every_section_a_document_points_to_exists(doc):
    """A moved or renamed section leaves no pointer to nothing behind (the front page's long sections moved
    to docs/ once, and a pointer to one of them stayed)."""
    missing = [f"{target.relative_to(ROOT)}: \"{heading}\"" for target, heading in section_references(ROOT / doc)
               if not target.exists() or not any(heading.lower() in h for h in _headings(target))]
    assert not missing, f"{doc}: sections it points to that do not exist: {missing}"


def test_a_pointer_to_a_moved_section_is_caught(tmp_path):
    doc = tmp_path / "README.md"
    doc.write_text("# Top\n## Run\nsee section \"Run\" and section \"Rollout kernels\"\n")
    missing = [h for target, h in section_references(doc) if not any(h.lower() in x for x in _headings(target))]
    assert missing == ["Rollout kernels"]
