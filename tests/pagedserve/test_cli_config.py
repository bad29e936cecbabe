"""Config dataclasses as flags: ``to_flags`` writes what ``add_arguments`` parses back, and a
value a config refuses ends the CLI with one line."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any

import pytest

from compute.batch.scheduler import SchedulerConfig
from compute.worker import ComputeConfig
from kvstore.daemon import KVStoreConfig
from pagedserve.cli import main
from pagedserve.config import add_arguments, from_namespace, to_flags

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


@pytest.mark.parametrize(
    "config",
    [
        SchedulerConfig(),
        SchedulerConfig(64, 2048, prefill_interval=3),
        ComputeConfig(),
        KVStoreConfig(),
    ],
)
def test_to_flags_round_trips_through_the_generated_parser(config: DataclassInstance) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, type(config))
    assert from_namespace(type(config), parser.parse_args(to_flags(config))) == config


def test_to_flags_writes_booleans_as_their_flag_or_its_negation() -> None:
    fields = [f for f in dataclasses.fields(KVStoreConfig) if f.type in (bool, "bool")]
    assert len(fields) >= 2, "KVStoreConfig has booleans to write"
    flips: dict[str, Any] = {f.name: not f.default for f in fields}
    flipped = dataclasses.replace(KVStoreConfig(), **flips)
    flags = to_flags(flipped)
    for field in fields:
        flag = field.name.replace("_", "-")
        assert (f"--{flag}" in flags) != (f"--no-{flag}" in flags)
    parser = argparse.ArgumentParser()
    add_arguments(parser, KVStoreConfig)
    assert from_namespace(KVStoreConfig, parser.parse_args(flags)) == flipped


def test_a_refused_value_is_one_line_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["compute", "--prefill-interval", "0"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "error: --prefill-interval must be at least 1" in err and "Traceback" not in err
