"""Shared by the CLI tests: the tiny Llama they calibrate and the calibration text."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def llama_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def calib_txt(shared_data):
    return shared_data / "calibration" / "groups_merged.txt"
