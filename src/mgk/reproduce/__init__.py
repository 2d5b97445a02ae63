"""``mgk reproduce``: the paper's tables as resumable grids of ``mgk train`` runs, on one machine or a cluster.

Modules: :mod:`.experiments` (the tables as data, with the paper's numbers), :mod:`.scales` (paper / cpu / smoke
settings per task), :mod:`.grid` (runs and their commands), :mod:`.executor` (local processes or submitit jobs),
:mod:`.collect`, :mod:`.report` and :mod:`.plots` (REPORT.md, report.json, plots), :mod:`.cli`.
"""
from .experiments import EXPERIMENTS, Experiment, Row, get_experiment
from .grid import Run, expand

__all__ = ["EXPERIMENTS", "Experiment", "Row", "Run", "expand", "get_experiment"]
