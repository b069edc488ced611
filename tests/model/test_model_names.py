"""GPUFEED_MODEL's torchvision names, known without importing torch."""

from __future__ import annotations

import pytest
import torchvision
from torchvision.models import list_models

from worker.base.errors import ConfigError
from worker.model.names import check_name, registered_models


def test_the_source_scan_finds_exactly_torchvisions_classification_models() -> None:
    assert registered_models() == frozenset(list_models(module=torchvision.models))


def test_a_name_is_matched_regardless_of_case_only_where_one_name_matches() -> None:
    assert check_name("ResNet18") == "resnet18"
    assert check_name("NULL") == "NULL"  # the null model takes any case already
    assert check_name("./ResNet18") == "./ResNet18"  # a path is a path
    with pytest.raises(ConfigError, match="unknown model 'Net'"):
        check_name("Net", known=["net", "NET"])


def test_without_the_names_the_check_waits_for_the_loader() -> None:
    assert check_name("resnet5", known=[]) == "resnet5"
    with pytest.raises(ConfigError, match="did you mean resnet50"):
        check_name("resnet5", known=["resnet50", "vgg11"])
