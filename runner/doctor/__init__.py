"""`runner doctor`: host checks without TensorFlow (checks.py), TensorFlow and TPU checks in a killable child
(probe.py), gathered into one report (report.py)."""

from runner.doctor.report import run_doctor

__all__ = ["run_doctor"]
