"""The benches' training functions, run for a few steps at a tiny size under raylaunch on the shared cluster, with
the benches' own specs: each reports every figure its bench reads. The benches themselves are not in the suite (they
take minutes and their figures are timings), and one broke silently for days when a field it read was renamed
(bench/checkpoint_fn.py read ``_Write._thread`` after the rank's lanes replaced it): this fails first."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from bench import checkpoints, elastic, recovery
from jobs.driver.driver import Driver
from jobs.spec import load_spec_text

ROOT = Path(__file__).resolve().parent.parent


def _run(text: str, overrides: list[str] | None = None):
    result = Driver(load_spec_text(text, overrides or []), can_grow=False).run()
    assert result.status == "succeeded", result.error
    return result


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_make_bench_function_reports_its_steps_saves_and_snapshots(ray_cluster, tmp_path):
    """bench/fn.py through bench/bench.yaml, as ``make bench`` runs it under raylaunch (its defaults on)."""
    spec = yaml.safe_load((ROOT / "bench" / "bench.yaml").read_text())
    spec["storage"] = str(tmp_path / "runs")
    out = tmp_path / "result.json"
    spec["config"] = {"steps": 24, "log_block": 4, "model": "tiny_mlp", "checkpoint_at": [12],
                      "result_path": str(out), "pid_dir": str(tmp_path)}
    _run(yaml.safe_dump(spec))
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["restarted"] is False
    for key in ("first_step_at", "steady_step_s", "steady_cpu_s", "window_step_s", "steady_logged_s",
                "steady_quiet_s", "steady_paced_s", "steady_unpaced_s"):
        assert isinstance(result[key], float) and result[key] > 0, key
    assert len(result["save_s"]) == 1 and len(result["local_save_s"]) == 1
    assert isinstance(result["snapshots"], int) and result["snapshot_every"] >= 1  # raylaunch's default: snapshots
    assert {s["rank"] for s in _lines(tmp_path / "first_steps.jsonl")} == {0, 1}


def test_bench_checkpoint_function_reports_both_saves_and_the_steps_beside_the_write(ray_cluster, tmp_path):
    """bench/checkpoint_fn.py through bench/checkpoints.py's spec, its model 64 wide."""
    text = checkpoints.SPEC.format(name="ckpt-fn", reps=2, background="true", storage=tmp_path / "runs")
    result = _run(text, ["config.width=64", "config.warmup=2", "config.quiet=1"])
    out = result.return_value
    assert out["state_mb"] == 64 * 64 * 6 * 12 / 2**20
    assert len(out["save_state_s"]) == 2 and len(out["session_save_s"]) == 2 and len(out["session_call_s"]) == 2
    assert len(out["steps_quiet_s"]) == 2 and len(out["steps_during_write_s"]) >= 2 and len(out["steps_before_s"]) == 1
    assert all(s >= 0 for s in out["session_save_s"] + out["save_state_s"])
    assert out["writer_uss_mb"] > 0  # the rank's checkpoint writer process was found and measured


def test_bench_recovery_function_writes_the_records_the_bench_reads(ray_cluster, tmp_path):
    """bench/recovery_fn.py through bench/recovery.py's spec, with snapshots in memory as its snapshots arm."""
    config = {"state_mb": 0.3, "every": 3, "max_steps": 6, "steps_file": str(tmp_path / "steps.jsonl"),
              "pid_dir": str(tmp_path / "pids"), "stop_file": str(tmp_path / "stop")}
    (tmp_path / "pids").mkdir()
    text = recovery.SPEC.format(name="recovery-fn", config=json.dumps(config), nodes=2, checkpoint="{keep: 2}",
                                storage=tmp_path / "runs")
    result = _run(text, [f"{recovery.SNAPSHOTS_KEY}=auto"])
    assert result.return_value == {"steps": 6}
    records = _lines(tmp_path / "steps.jsonl")
    assert records[0]["restored"] == 0
    assert [r["step"] for r in records if "step" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["saved"] for r in records if "saved" in r] == [3, 6]
    assert all(r["ended"] >= r["began"] for r in records if "step" in r)
    assert {p.name for p in (tmp_path / "pids").iterdir()} == {"rank-0.pid", "rank-1.pid"}
    assert result.last_step == 6 and len(result.checkpoints) == 2


def test_bench_elastic_function_writes_the_records_the_bench_reads(ray_cluster, tmp_path):
    """bench/elastic_fn.py through bench/elastic.py's spec."""
    config = {"max_steps": 4, "every": 2, "step_s": 0.01, "steps_file": str(tmp_path / "steps.jsonl"),
              "ranks_file": str(tmp_path / "ranks.jsonl"), "stop_file": str(tmp_path / "stop")}
    text = elastic.SPEC.format(name="elastic-fn", config=json.dumps(config), resize_s=30, storage=tmp_path / "runs")
    result = _run(text)
    assert result.world_size == 2
    records = _lines(tmp_path / "steps.jsonl")
    assert [r["step"] for r in records if "step" in r] == [1, 2, 3, 4]
    assert all(r["world_size"] == 2 for r in records if "step" in r)
    assert [r["checkpoint"] for r in records if "checkpoint" in r] == [2, 4]
    assert sorted(r["rank"] for r in _lines(tmp_path / "ranks.jsonl")) == [0, 1]
