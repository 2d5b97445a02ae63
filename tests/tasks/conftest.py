"""Fixtures of the task tests: ``lra_data``, the LRA data builders of tests/data/lra_fixtures.py (tiny IMDb, AAN,
CIFAR and Pathfinder trees), loaded from its file instead of through ``sys.path``."""
import importlib.util
from pathlib import Path

import pytest

_BUILDERS = Path(__file__).resolve().parents[1] / "data" / "lra_fixtures.py"


@pytest.fixture(scope="session")
def lra_data():
    """The module tests/data/lra_fixtures.py (``make_imdb_tar``, ``make_aan_dir``, ``cifar_pickle_files``, ...)."""
    spec = importlib.util.spec_from_file_location("mgk_test_lra_fixtures", _BUILDERS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
