"""bench/cost_sweep.py: a tiny CPU sweep end to end, and the arithmetic of its scores."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from bench.cost_report import Row, score
from bench.cost_rig import BLOCK, prefill_steps
from bench.cost_sweep import cross_validate, main, seeded
from kvstore.cost_model import Choice

TABLE_ROW = re.compile(r"^\| (prefix|preempt) \| (absent|present) \| ")
SUMMARY = re.compile(
    r"^- (\w+) ([\w ]+?): faster path chosen in (\d+)/(\d+) \(([\d.]+)%\), ([\d.]+) ms lost of "
    r"([\d.]+) ms oracle \(([\d.]+)%\): goal (met|NOT met)"
)


def test_tiny_sweep_end_to_end_and_its_report_adds_up(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out_json = tmp_path / "sweep.json"
    argv = "--device cpu --blocks 1,4 --contexts 0,32 --suffixes 0,24 --repeats 1 --decodes 4"
    argv += " --decode-context 48 --recalibrate --seed-tokens 24,100 --seed-contexts 16,48"
    argv += f" --json {out_json}"
    results = main(argv.split())
    out = capsys.readouterr().out
    rows = results["shipped"]
    # 2 batches x (2 suffixes x 2 contexts x 2 sizes of prefix loads + 2 sizes of preemptions)
    assert [(r.kind, r.batch, r.suffix, r.context, r.blocks) for r in rows][3:6] == [
        ("prefix", "absent", 0, 32, 4),
        ("prefix", "absent", 24, 0, 1),
        ("prefix", "absent", 24, 0, 4),
    ]
    assert len(rows) == 20 and sum(r.kind == "preempt" for r in rows) == 4
    assert all(r.move_s > 0 and r.recompute_s >= 0 for r in rows)
    assert "# cost sweep" in out and "commit" in out and "torch" in out

    printed = [line for line in out.split("## ")[1].splitlines() if TABLE_ROW.match(line)]
    assert len(printed) == len(rows)  # the shipped model's table: every point
    for line, row in zip(printed, rows, strict=True):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert int(cells[3]) == row.suffix and int(cells[4]) == row.blocks
        move, recompute, lost = float(cells[6]), float(cells[8]), float(cells[11])
        chosen, faster = cells[9], cells[10]
        assert (chosen, faster) == (row.chosen, row.faster)
        assert lost == pytest.approx(
            (move if chosen == "move" else recompute) - min(move, recompute), abs=2e-3
        )

    summaries = [SUMMARY.match(line) for line in out.split("## ")[1].splitlines()]
    found = {(m[1], m[2]): m for m in summaries if m}
    for (kind, group), m in found.items():
        subset = [
            r for r in rows if r.kind == kind and group in ("all", r.batch, f"suffix {r.suffix}")
        ]
        right = sum(r.lost_s == 0 for r in subset)
        lost, oracle = sum(r.lost_s for r in subset), sum(r.oracle_s for r in subset)
        assert (int(m[3]), int(m[4])) == (right, len(subset))
        assert float(m[5]) == pytest.approx(100 * right / len(subset), abs=0.05)
        assert float(m[6]) == pytest.approx(lost * 1e3, abs=1e-3)
        assert float(m[7]) == pytest.approx(oracle * 1e3, abs=1e-3)
        assert float(m[8]) == pytest.approx(100 * lost / oracle, abs=0.005)
        assert (m[9] == "met") == (right / len(subset) >= 0.95 and lost / oracle <= 0.05)
    groups = ("all", "absent", "present", "suffix 0", "suffix 24")
    assert set(found) == {(k, g) for k in ("prefix", "preempt") for g in groups} - {
        ("preempt", "suffix 24")  # a victim has no suffix
    }

    dumped = json.loads(out_json.read_text())
    assert [len(dumped[k]) for k in ("shipped", "refit", "seeded")] == [20, 20, 20]
    assert dumped["shipped"][0]["move_s"] == rows[0].move_s
    assert len(out.split("## ")) == 4  # the header, then the shipped, refit and seeded models


def row(kind: str, batch: str, n: int, move: float, rec: float, chosen: str, ctx: int = 0) -> Row:
    return Row(kind, batch, ctx, n, 0.0, 0.0, move, rec, chosen)


def test_score_arithmetic() -> None:
    rows = [
        row("prefix", "absent", 1, 1.0, 3.0, "move"),  # right
        row("prefix", "absent", 2, 2.0, 1.5, "move"),  # wrong: 0.5 lost of 1.5
        row("prefix", "absent", 4, 4.0, 4.0, "recompute"),  # a tie counts as right
        row("prefix", "absent", 8, 1.0, 0.5, "recompute"),  # right
    ]
    s = score(rows)
    assert (s.points, s.right) == (4, 3)
    assert s.lost_s == pytest.approx(0.5) and s.oracle_s == pytest.approx(1.0 + 1.5 + 4.0 + 0.5)
    assert s.right_pct == 75.0 and s.lost_pct == pytest.approx(100 * 0.5 / 7.0)
    assert [r.blocks for r in s.worst] == [2] and not s.met
    assert score(rows[:1] * 19 + rows[1:2]).met  # 95% right, 0.5 s lost of 20.5 (2.4%)
    assert not score(rows[:1] * 18 + rows[1:2] * 2).met  # 90% right
    slow = row("prefix", "absent", 1, 10.0, 1.0, "move")
    assert not score(rows[:1] * 19 + [slow]).met  # 95% right, but 9 s lost of 20 (45%)


def test_row_of_maps_choices_and_missing_predictions() -> None:
    r = Row.of("prefix", "absent", 0, 4, 0, Choice("load", "x", None, 2e-3), 1e-3, 3e-3)
    assert (r.chosen, r.predicted_move_s, r.predicted_recompute_s) == ("move", math.inf, 2e-3)
    p = Row.of("preempt", "present", 0, 4, 0, Choice("recompute", "x", 1e-3, 2e-3), 1e-3, 3e-3)
    assert p.chosen == "recompute" and p.lost_s == pytest.approx(2e-3) and p.faster == "move"


def test_prefill_steps_follow_the_scheduler_budget() -> None:
    assert prefill_steps(8192, 8192, 0) == [8192]
    assert prefill_steps(8192, 8192, 64) == [8128, 64]  # the decodes take their share first
    assert prefill_steps(100, 8192, 64) == [100]
    assert prefill_steps(0, 8192, 64) == []
    with pytest.raises(ValueError):
        prefill_steps(16, 64, 64)


def synthetic_grid() -> list[Row]:
    """Rows whose actual costs follow CostRefit's own forms exactly; the shipped model's
    predictions are off (move 10x, recompute flat) and it chose wrong where loading is slower."""
    rows = []
    for batch in ("absent", "present"):
        fixed = 1e-3 if batch == "absent" else 2e-4
        for ctx in (0, 512, 2048, 8192):
            for n in (1, 2, 4, 8, 16, 32, 64, 128):
                t = n * BLOCK
                move = 5e-5 + 2e-4 * n
                rec = fixed + 4e-7 * ctx + 1e-6 * t + 1e-10 * (t * ctx + t * t / 2)
                rows.append(Row("prefix", batch, ctx, n, 10 * move, 3e-3, move, rec, "move"))
    return rows


def test_cross_validated_refit_recovers_the_costs_out_of_fold() -> None:
    rows = synthetic_grid()
    assert score(rows).right < len(rows)  # the shipped predictions miss some points
    refit = cross_validate(rows, folds=2)
    for r in refit:
        assert r.predicted_move_s == pytest.approx(r.move_s, rel=1e-6)
        assert r.predicted_recompute_s == pytest.approx(r.recompute_s, rel=1e-6)
    assert score(refit).right == len(rows) and score(refit).lost_s == 0


def test_seeded_refit_prices_recompute_from_off_grid_points_only() -> None:
    rows = synthetic_grid()
    seeds = {
        busy: [
            (t, c, fixed + 4e-7 * c + 1e-6 * t + 1e-10 * (t * c + t * t / 2))
            for t in (40, 360, 1400)
            for c in (1024, 4096)
        ]
        for busy, fixed in ((False, 1e-3), (True, 2e-4))
    }
    again = seeded(rows, seeds)
    for r, before in zip(again, rows, strict=True):
        assert r.predicted_recompute_s == pytest.approx(r.recompute_s, rel=1e-6)
        assert r.predicted_move_s == before.predicted_move_s  # moves keep the calibration


def test_peer_kind_times_copies_from_a_second_pool_beside_the_same_recomputes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--kinds peer,prefix`` on CPU: a second /dev/shm pool plays the other GPU; each point's
    copy (``PeerCopier.copy``) and CPU-tier load are timed against the one recompute, and the
    copy is priced by the line the copier's calibration fitted."""
    argv = "--device cpu --blocks 1,4 --contexts 0 --suffixes 1 --repeats 1 --batches absent"
    rows = main([*argv.split(), "--kinds", "peer,prefix"])["shipped"]
    assert [(r.kind, r.blocks) for r in rows] == [
        ("prefix", 1), ("peer", 1), ("prefix", 4), ("peer", 4)
    ]  # fmt: skip
    for prefix, peer in zip(rows[::2], rows[1::2], strict=True):
        assert peer.recompute_s == prefix.recompute_s  # one recompute timing, two questions
        assert peer.move_s > 0 and math.isfinite(peer.predicted_move_s)
    assert rows[3].predicted_move_s > rows[1].predicted_move_s  # 4 blocks cost more than 1
    assert "- peer all: faster path chosen in" in capsys.readouterr().out
