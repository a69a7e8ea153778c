"""pipeline/triton/repository.py: `deploy` of a torch config needs built engines and writes nothing without them."""

from __future__ import annotations

import pytest

from pipeline.config import parse_config
from pipeline.errors import EngineError
from pipeline.triton.repository import deploy
from tests.conftest import tiny_config_dict


def test_torch_deploy_needs_built_engines(tmp_path):
    config = parse_config(tiny_config_dict(tmp_path))
    with pytest.raises(EngineError, match="no completed target engine.*pipeline build"):
        deploy(config, tmp_path / "engines")
    assert not (tmp_path / "engines" / config.name / "triton").exists()
