"""The entry points: a user's mistake is one line and exit status 2; a bug keeps its traceback."""

import logging

import pytest

from ushash.config import user_errors
from ushash.data.store import FeatureStoreError


@pytest.mark.parametrize("err", [ValueError("bits=12 is not a multiple of 8; use 16, 32, 64 or 128"),
                                 FileExistsError("exports/x exists; pass overwrite=true or another out="),
                                 FeatureStoreError("no feature store at data/features/x; run python -m ushash.extract")])
def test_a_mistake_is_one_line_and_status_2(err, caplog, monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)

    def main(cfg):
        raise err

    with caplog.at_level(logging.ERROR, logger="ushash"), pytest.raises(SystemExit) as e:
        user_errors(main)({})
    assert e.value.code == 2
    (rec,) = caplog.records
    assert rec.getMessage().startswith(str(err)) and "\n" not in rec.getMessage() and rec.exc_info is None


def test_a_bug_keeps_its_traceback_and_full_error_shows_mistakes_too(monkeypatch):
    def bug(cfg):
        raise TypeError("unsupported operand")

    with pytest.raises(TypeError):
        user_errors(bug)({})
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")

    def mistake(cfg):
        raise ValueError("bad")

    with pytest.raises(ValueError):
        user_errors(mistake)({})


def test_a_verb_returns_what_main_returns():
    assert user_errors(lambda cfg: 0.5)({}) == 0.5
