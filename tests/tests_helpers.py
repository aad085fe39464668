"""Helpers importable from any test file (pytest puts tests/ on sys.path via rootdir conftest)."""
from conftest import tiny_overrides as tiny_overrides_for  # noqa: F401
