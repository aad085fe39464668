"""Experiment 07's tables and figures from its recorded runs (moerl.analysis.dose_report).

    .venv/bin/python experiments/07_dose_threshold/report.py [--runs results/runs] [--out results/07_dose_threshold]
    .venv/bin/python experiments/07_dose_threshold/report.py --pilots results/pilots/07_*   # the regime pilots
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from moerl.analysis.dose_report import main  # noqa: E402

if __name__ == "__main__":
    main()
