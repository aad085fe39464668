"""The README is a front page whose numbers come from results/: a test fails when they drift."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests_helpers import load_script

REPO = Path(__file__).resolve().parents[1]
numbers = load_script("scripts/write_readme_numbers.py", "moerl_readme_numbers")


@pytest.mark.slow
def test_every_generated_section_matches_the_recorded_results(capsys):
    assert numbers.main(["--check"]) == 0, capsys.readouterr().out


def test_a_drifted_number_is_caught_and_rewritten(tmp_path, capsys):
    for rel in numbers.SECTIONS["00"][0]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, tmp_path / rel)
    readme = tmp_path / "README.md"
    text = readme.read_text()
    begin, end = numbers.markers("00")
    section = text[text.index(begin):text.index(end)]
    drifted = re.sub(r"0\.71×", "0.70×", section, count=1)
    assert drifted != section  # the R3 ratio is in the generated table
    readme.write_text(text.replace(section, drifted))
    assert numbers.main(["--check", "--only", "00", "--root", str(tmp_path)]) == 1
    assert "README.md: section '00'" in capsys.readouterr().out
    assert numbers.main(["--only", "00", "--root", str(tmp_path)]) == 0
    assert readme.read_text() == (REPO / "README.md").read_text()


def test_a_missing_section_is_named(tmp_path):
    (tmp_path / "README.md").write_text("# no markers\n")
    with pytest.raises(SystemExit, match="README.md: no generated section 'experiments'"):
        numbers.main(["--only", "experiments", "--root", str(tmp_path)])


def test_a_front_page_grown_past_its_limit_is_refused_before_writing(tmp_path, capsys):
    """A grid that completes adds verdict lines to the front page: the writer refuses, names the page and the
    limit, and leaves the file as it was, rather than committing a page the tests then reject."""
    readme = tmp_path / "README.md"
    begin, end = numbers.markers("experiments")
    readme.write_text(f"{begin}\n{end}\n" + "x" * numbers.FRONT_PAGE_LIMIT)
    before = readme.read_text()
    assert numbers.main(["--only", "experiments", "--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("README.md: would be") and f"{numbers.FRONT_PAGE_LIMIT}-byte limit" in out
    assert readme.read_text() == before


def test_front_page_stays_short_and_lists_every_experiment():
    text = (REPO / "README.md").read_text()
    assert len(text.encode()) <= numbers.FRONT_PAGE_LIMIT
    table = text[text.index(numbers.markers("experiments")[0]):text.index(numbers.markers("experiments")[1])]
    for exp in sorted(p.name for p in (REPO / "experiments").iterdir() if p.name[:2].isdigit()):
        assert f"[{exp}](experiments/{exp}/README.md)" in table
        launcher = next(p for p in ("launch.sh", "run.sh") if (REPO / "experiments" / exp / p).exists())
        assert f"experiments/{exp}/{launcher}" in table
    assert not re.search(r"\d+ passed", text)  # test counts go stale: none on the front page


DOCUMENTS = sorted([REPO / "README.md", *REPO.glob("docs/*.md"), *REPO.glob("experiments/*/README.md"),
                    REPO / "analysis" / "README.md", *REPO.glob("results/*.md")])


@pytest.mark.parametrize("doc", [str(d.relative_to(REPO)) for d in DOCUMENTS])
def test_every_relative_link_of_a_document_resolves(doc):
    """A figure or file a document links to is committed: a figure a report drew but nobody added shows
    here on a clean clone (the registered grids' figures are written only once their grid is complete)."""
    path = REPO / doc
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text())
    local = [link for link in links if not re.match(r"[a-z]+://|mailto:", link)]
    assert [link for link in local if not (path.parent / link).exists()] == []
    if doc == "README.md":
        assert local


def test_the_experiments_table_counts_the_runs_themselves(tmp_path):
    """Runs and their time come from the run directories (a finished run has summary.json; its time is its
    logged step and evaluation times), not from sweep.json, which a sweep killed at a session's end could lack."""
    import json

    for seed, rows in ((0, [{"step": 0, "time/eval": 2.0}, {"step": 1, "time/step": 3.0, "time/eval": 2.0}]),
                       (1, [{"step": 1, "time/step": 4.0}]), (2, [{"step": 1, "time/step": 100.0}])):
        run = tmp_path / "07_x" / "arm" / f"seed{seed}"
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if seed < 2:  # seed 2 is still running: no summary
            (run / "summary.json").write_text("{}")
    (tmp_path / "07_x" / "sweep.json").write_text('{"invocations": [], "runs": {}, "total_wall_seconds": 0}')
    assert numbers.recorded_runs(tmp_path / "07_x") == (2, 11.0)
    assert numbers.recorded_runs(tmp_path / "nowhere") == (0, 0)


def test_the_headline_names_few_verdicts_and_groups_many_by_comparison(monkeypatch):
    """A grid with up to HEADLINE_VERDICTS verdicts is listed verdict by verdict; a per-rung grid names each
    comparison once, with its rungs grouped by verdict, so the front page says what was found at which rung."""
    many = {f"r3 prevents collapse at rung{i}": {"verdict": f"partly ({i} of 5)", "power": {"n": 5}} for i in (1, 2)}
    many |= {f"baseline collapses at rung{i}": {"verdict": "yes", "power": {"n": 5}} for i in range(8)}
    many |= {"mis prevents collapse at rung0": {"verdict": "not tested", "power": {"n": 5}}}  # left to the README
    result = {"verdicts": {"few": {"r3 like_control": {"verdict": "inconclusive", "gain": {"n": 12}},
                                   "tis helps": {"verdict": "not tested", "floor_ungated": "yes", "gain": {"n": 12}}},
                           "many": many},
              "progress": {"few": {"finished": 24, "planned": 24, "complete": True},
                           "many": {"finished": 50, "planned": 50, "complete": True},
                           "running": {"finished": 3, "planned": 20, "complete": False}}}
    monkeypatch.setattr(numbers, "_confirmatory", lambda runs_root: {"result": result})
    lines = numbers.section_07_headline(Path("unused")).splitlines()
    assert lines[2] == ("- few (12 seeds): R3 ends like the control **inconclusive**; "
                        "TIS beats no correction **not tested** (acts on too few tokens)")
    assert lines[3] == ("- many (5 seeds): R3 prevents the collapse: **partly (1 of 5)** with rung1, **partly (2 of 5)** "
                        "with rung2; no correction collapses: **yes** with " + ", ".join(f"rung{i}" for i in range(8)))
    assert lines[4] == "- still running: `running` 3/20"


def test_the_front_page_still_fits_once_every_registered_grid_is_complete(monkeypatch):
    """The headline grows as grids complete: with every registered grid complete -- a complete grid with its
    verdicts as recorded, the others with each verdict at its longest wording -- the front page must still
    fit, so that no landing run makes the page fail later."""
    from moerl.analysis import confirmatory, registration

    registered = registration.load(registration.analysis_path("07_dose_threshold"))
    comparisons = registered["rules"]["confirmatory_comparisons"]["value"]
    kinds = ["not tested", "inconclusive", "yes", "no", "partly (2 of 5)"]
    verdicts = {}
    for grid, spec in confirmatory.path_grids(registered).items():
        if grid not in comparisons and grid != "confirmatory_control":
            continue  # the crossover: its comparisons are named in crossover_reading, its verdict code not written yet
        names = ["regime"] if grid == "confirmatory_control" else [
            f"{c.removesuffix(' at each rung')} at {rung}" if c.endswith(" at each rung") else c
            for c in comparisons[grid] for rung in (spec.rungs if c.endswith(" at each rung") else [None])]
        many = len(names) > numbers.HEADLINE_VERDICTS

        def longest(name: str) -> dict:  # the longest marks the report can give this comparison
            if re.fullmatch(r"(tis|icepop|mis) helps", name):
                return {"floor_ungated": "inconclusive"}
            if re.search(r"like_control|collapse", name):
                return {"ungated": "inconclusive"}
            return {}

        verdicts[grid] = {name: {"verdict": kinds[i % len(kinds)] if many else "inconclusive",
                                 "gain": {"n": len(spec.seeds)}, **longest(name)} for i, name in enumerate(names)}
    recorded = numbers._confirmatory(REPO / "results" / "runs")["result"]
    verdicts |= {grid: found for grid, found in recorded["verdicts"].items() if recorded["progress"][grid]["complete"]}
    progress = {g: {"finished": 1, "planned": 1, "complete": True} for g in verdicts}
    monkeypatch.setattr(numbers, "_confirmatory", lambda runs_root: {"result": {"verdicts": verdicts,
                                                                                "progress": progress}})
    text = (REPO / "README.md").read_text()
    begin, end = numbers.markers("07_headline")
    start, stop = text.index(begin) + len(begin), text.index(end)
    projected = text[:start] + "\n" + numbers.section_07_headline(Path("unused")) + "\n" + text[stop:]
    assert len(projected.encode()) <= numbers.FRONT_PAGE_LIMIT, len(projected.encode())


# Numbers an experiment README's prose may state without a generated section: settings and expectations
# written before the runs, each named with why. Any other number in the prose must appear in one of the
# README's generated sections or in the experiment's own config files (base.yaml, arms, analysis.yaml).
PROSE_CONSTANTS = {
    "00_tiny_moe_cpu": {"1.2e-4", "1e-3", "1e-12", "0.3", "25×", "35 %"},  # the expectations, stated before the runs
    "05_mismatch_consequences": {"2.13",  # the torch build
                                 "3e-3",  # the earlier pilot's learning rate
                                 "0.97", "1.03"},  # experiment 00's MIS band
    "06_routing_geometry": {"99 %",  # "99 % or more": the fits table's random-init column, generated below it
                            "1.5",  # a threshold τ of F(τ)
                            "2.446", "2.5", "2.827",  # the routed scaling factors of the published configs
                            "0.02",  # the init std
                            "70 %", "5.4"},  # the GPU memory plan (tests/analysis/test_gpu_width_geometry.py)
    "07_dose_threshold": {"5.5"},  # the main grid's time plan, written before it ran
}
PROSE_NUMBER = re.compile(r"(?<![\w.^])[-+−]?\d+(?:\.\d+)?(?:e-?\d+)?(?: ?%|×)?")


def _values(text: str) -> set[float]:
    out = set()
    for m in PROSE_NUMBER.findall(text):
        t = m.replace("−", "-").replace(" ", "").rstrip("×")
        scale = 0.01 if t.endswith("%") else 1.0
        try:
            v = abs(float(t.rstrip("%")))
        except ValueError:
            continue
        out |= {round(v, 12), round(v * scale, 12)}
    return out


def prose_numbers_without_a_source(readme: Path) -> list[str]:
    """The measured-looking numbers (a decimal point, %, × or an exponent) in a README's prose that neither
    a generated section of it nor the experiment's config files contain."""
    text = readme.read_text()
    generated = "\n".join(re.findall(r"<!-- generated:\S+ begin.*?-->(.*?)<!-- generated:\S+ end -->", text, re.S))
    prose = re.sub(r"<!-- generated:\S+ begin.*?<!-- generated:\S+ end -->", "", text, flags=re.S)
    prose = re.sub(r"```.*?```", "", prose, flags=re.S)
    prose = re.sub(r"`[^`]*`|arXiv \d+\.\d+|\]\([^)]*\)", "", prose)  # code, paper ids, link targets
    experiment = readme.parent.name if readme.parent != REPO else None  # the front page has no config of its own
    configs = "".join(f.read_text() for f in readme.parent.rglob("*.yaml")) if experiment else ""
    known = _values(generated) | _values(configs)
    allowed = PROSE_CONSTANTS.get(experiment, set()) | {"95 %", "80 %"}  # interval and power levels
    stray = []
    for line in prose.splitlines():
        for m in PROSE_NUMBER.findall(line):
            if not any(c in m for c in ".%×e") or m.strip() in allowed:
                continue
            if not _values(m) & known:
                stray.append(f"{m!r} in: {line.strip()[:90]}")
    return stray


@pytest.mark.parametrize("readme", ["README.md", *(f"experiments/{e}/README.md" for e in sorted(PROSE_CONSTANTS))])
def test_a_readmes_prose_cites_numbers_it_does_not_type(readme):
    stray = prose_numbers_without_a_source(REPO / readme)
    assert stray == [], ("numbers typed into the prose (put them in a generated section, or name a "
                         "constant in PROSE_CONSTANTS with why):\n  " + "\n  ".join(stray))


def test_a_measured_number_typed_into_the_prose_is_caught(tmp_path):
    readme = tmp_path / "07_dose_threshold" / "README.md"
    readme.parent.mkdir()
    readme.write_text("<!-- generated:x begin (w) -->\ngain +0.106\n<!-- generated:x end -->\n"
                      "The control gains +0.106 (cited) and R3 ends 0.37 below it; `lr 3e-4` is code.\n")
    stray = prose_numbers_without_a_source(readme)  # +0.106 is cited from the section, 3e-4 is code
    assert len(stray) == 1 and stray[0].startswith("'0.37' in: The control gains +0.106")
