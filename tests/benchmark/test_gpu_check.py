"""`make gpu-check`'s measurement script, run on the CPU with a tiny architecture (the GPU machine runs the
real ones): it writes the cost profile and the ar vs oracle comparison, and says so where CUDA is missing."""

from __future__ import annotations

import json

import torch

from benchmark import gpu_check
from specactor_engine.policies.verify_length import CostProfile


def test_on_the_cpu_it_writes_a_loadable_cost_profile_and_an_exact_oracle_run(tmp_path):
    code = gpu_check.main(["--out", str(tmp_path), "--device", "cpu", "--models", "tiny", "--oracle-model", "tiny",
                           "--rows", "1,4", "--contexts", "32,64", "--max-k", "3", "--oracle-rows", "4",
                           "--max-new-tokens", "20", "--dtype", "float32"])
    assert code == 0
    assert json.loads((tmp_path / "environment.json").read_text())["device"] == "cpu"
    table = json.loads((tmp_path / "cost_tiny.json").read_text())
    profile = CostProfile.from_dict(table["profile"])
    assert profile.batch_sizes == (1, 4) and profile.widths == (1, 2, 3, 4)
    assert [t.context for t in profile.tables] == [32, 64]
    (run,) = json.loads((tmp_path / "ar_vs_oracle.json").read_text())["runs"]
    assert run["identical_sequences"] == "16/16"  # fp32: the oracle's outputs are ar's
    assert run["accepted"] == run["drafted"] > 0  # ... so every draft is accepted
    assert run["tokens"] == 16 * 20 and run["oracle_rounds"] < run["ar_rounds"]


def test_without_cuda_it_says_so_and_succeeds(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", str(tmp_path / "out")]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


def test_the_round_profile_alternates_the_dtypes_and_profiles_every_run(tmp_path):
    from benchmark import gpu_round_profile

    code = gpu_round_profile.main(["--out", str(tmp_path), "--device", "cpu", "--arch", "tiny", "--rows", "2",
                                   "--runs", "2", "--max-new-tokens", "6", "--dtypes", "float32,bfloat16"])
    assert code == 0
    runs = json.loads((tmp_path / "rounds.json").read_text())["runs"]
    assert [(r["run"], r["dtype"]) for r in runs] == [(0, "float32"), (0, "bfloat16"), (1, "float32"),
                                                       (1, "bfloat16")]
    assert all(r["rounds"] == 5 and r["seconds"] > 0 for r in runs)  # the prefill samples the first token
    for run in runs:
        profile = (tmp_path / f"profile_{run['dtype']}_run{run['run']}.txt").read_text()
        assert "runner.py" in profile and "(forward)" in profile
