"""scripts/mutants.py: every planted bug still finds the code it targets (the run itself is too long for the suite;
`.venv/bin/python scripts/mutants.py` runs it)."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.conftest import REPO


def _mutants_module():
    spec = importlib.util.spec_from_file_location("mutants_script", REPO / "scripts" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


MUTANTS = _mutants_module().MUTANTS


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_each_substitution_matches_exactly_once(mutant):
    text = (REPO / mutant.path).read_text()
    assert text.count(mutant.old) == 1, f"{mutant.name}: its old text is in {mutant.path} " \
                                        f"{text.count(mutant.old)} times; adapt it to the code as it is"
    assert mutant.new != mutant.old
