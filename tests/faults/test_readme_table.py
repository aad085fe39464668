"""docs/reliability.md's "Bad input" table is the suite's own case list, and each case names a real test."""
import ast
from pathlib import Path

from fault_cases import CASES, README, readme_section, render_table

HERE = Path(__file__).parent


def test_readme_table_is_generated_from_the_case_list():
    assert readme_section(README.read_text()) == render_table(), \
        "README 'Bad input' table is stale: run python tests/faults/fault_cases.py --write"


def test_every_case_names_an_existing_test():
    for case in CASES:
        file, name = case.test.split("::")
        tree = ast.parse((HERE / file).read_text())
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert name in names, f"{case.input!r} names {case.test}, which does not exist"
