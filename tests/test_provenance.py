"""Provenance in every file profuse writes (env.provenance through files.write_result), as
`profuse report` prints it and `profuse diff` compares it; fake git, nvidia-smi and cards."""

from __future__ import annotations

import csv
import json
import subprocess
from types import SimpleNamespace

import pytest
import torch
from cases import run_cli

from profuse import env, files
from profuse.report import provenance as P
from profuse.report import sweep as R


@pytest.fixture
def fresh(monkeypatch):
    """env's per-process caches emptied before and after, so each test reads its fakes."""
    env.source_tree.cache_clear()
    env.versions.cache_clear()
    yield monkeypatch
    env.source_tree.cache_clear()
    env.versions.cache_clear()


def fake_git(commit: str, status: str):
    def run(git, where, *args):
        return commit if args[0] == "rev-parse" else status

    return run


@pytest.mark.parametrize(("status", "dirty"), [("", False), (" M src/profuse/env.py", True)])
def test_the_source_tree_records_its_commit_and_whether_it_was_changed(fresh, status, dirty):
    fresh.setattr(env.shutil, "which", lambda name: f"/usr/bin/{name}")
    fresh.setattr(env, "_git", fake_git("a1b2c3d4" * 5, status))
    tree = env.source_tree()
    assert tree["commit"] == "a1b2c3d4" * 5 and tree["dirty"] is dirty


def test_no_git_or_no_checkout_records_none_and_never_fails(fresh):
    fresh.setattr(env.shutil, "which", lambda name: None)
    assert env.source_tree()["commit"] is None and env.source_tree()["dirty"] is None
    env.source_tree.cache_clear()

    def broken(git, where, *args):
        raise subprocess.CalledProcessError(128, ["git"], stderr="fatal: not a git repository")

    fresh.setattr(env.shutil, "which", lambda name: "/usr/bin/git")
    fresh.setattr(env, "_git", broken)
    assert env.source_tree() == {"commit": None, "dirty": None, "path": env.source_tree()["path"]}
    assert P.source_words(env.source_tree()).startswith("not a git checkout")


@pytest.mark.parametrize(("dirty_text", "dirty"), [("1", True), ("0", False)])
def test_a_copy_without_its_git_takes_the_commit_its_sender_names(fresh, dirty_text, dirty):
    """A tree sent to a GPU machine travels without .git, or with a stale one: the sender names
    the commit, and that is the one recorded."""
    fresh.setattr(env.shutil, "which", lambda name: None)
    fresh.setenv(env.SOURCE_COMMIT_ENV, "f00d" * 10)
    fresh.setenv(env.SOURCE_DIRTY_ENV, dirty_text)
    tree = env.source_tree()
    assert tree["commit"] == "f00d" * 10 and tree["dirty"] is dirty
    assert tree["told_by"] == env.SOURCE_COMMIT_ENV
    env.source_tree.cache_clear()
    fresh.setattr(env.shutil, "which", lambda name: f"/usr/bin/{name}")
    fresh.setattr(env, "_git", fake_git("a1b2c3d4" * 5, " M x.py"))  # a stale .git in the copy
    tree = env.source_tree()
    assert tree["commit"] == "f00d" * 10 and tree["git_saw"] == {"commit": "a1b2c3d4" * 5, "dirty": True}


def test_versions_name_every_package_and_none_where_missing(fresh):
    import importlib.metadata

    real = importlib.metadata.version

    def version(name):
        if name == "liger-kernel":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name) if name != "transformers" else "9.9.9"

    fresh.setattr(env.importlib.metadata, "version", version)
    v = env.versions()
    assert set(env.PACKAGES) <= set(v) and {"python", "cuda_runtime", "cudnn", "driver"} <= set(v)
    assert v["liger-kernel"] is None and v["transformers"] == "9.9.9" and v["torch"] == torch.__version__
    assert "liger-kernel -" in P.versions_words(v)


def test_a_gpu_card_from_nvidia_smi_and_from_torch_alone(fresh):
    props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", uuid="5f3c-77", multi_processor_count=132,
                            total_memory=85 * 10**9, major=9, minor=0)  # fmt: skip
    fresh.setattr(torch.cuda, "is_available", lambda: True)
    fresh.setattr(torch.cuda, "current_device", lambda: 0)
    fresh.setattr(torch.cuda, "get_device_properties", lambda device: props)
    asked = []

    def smi(device, fields, gpu_id=None):
        asked.append(gpu_id)
        values = ["NVIDIA H100 80GB HBM3", "GPU-5f3c-77", "580.82", "81559 MiB", "1755 MHz", "2619 MHz",
                  "1980 MHz", "2619 MHz", "700.00 W"]  # fmt: skip
        return dict(zip(fields, values))

    fresh.setattr(env, "_nvidia_smi", smi)
    card = env.card()
    assert asked == ["GPU-5f3c-77"]  # by UUID: CUDA_VISIBLE_DEVICES renumbers the indices
    assert card["name"] == props.name and card["uuid"] == "GPU-5f3c-77" and card["sm_count"] == 132
    assert (card["sm_clock"], card["max_sm_clock"], card["power_limit"]) == (
        "1755 MHz",
        "1980 MHz",
        "700.00 W",
    )
    words = P.card_words(card)
    assert "132 SMs" in words and "SM 1755 MHz of 1980 MHz" in words and "power limit 700.00 W" in words
    fresh.setattr(env, "_nvidia_smi", lambda *a, **k: {})  # no nvidia-smi: torch's properties
    card = env.card()
    assert card["source"] == "torch" and card["sm_count"] == 132 and "sm_clock" not in card
    assert "clocks and power not read" in P.card_words(card)


def test_a_cpu_card_names_the_model_and_cores(fresh):
    fresh.setattr(torch.cuda, "is_available", lambda: False)
    fresh.setattr(env, "cpu_model", lambda: "AMD EPYC 7B13")
    card = env.card()
    assert card["kind"] == "cpu" and card["cpu_model"] == "AMD EPYC 7B13" and card["cpu_count"] >= 1
    assert P.card_words(card).startswith("CPU: AMD EPYC 7B13 (")


def test_the_command_keeps_only_the_environment_that_changes_behaviour(fresh):
    fresh.setenv("PROFUSE_FAST_LAUNCH", "0")
    fresh.setenv("TRITON_INTERPRET", "1")
    fresh.setenv("HOME_OF_SOMETHING_ELSE", "x")
    prov = env.provenance("2026-12-07T04:00:00Z", ["step", "--out", "my dir"])
    cmd = prov["command"]
    assert cmd["env"] == {"PROFUSE_FAST_LAUNCH": "0", "TRITON_INTERPRET": "1"}
    assert cmd["profuse_args"] == ["step", "--out", "my dir"]
    assert P.command_words(cmd) == "PROFUSE_FAST_LAUNCH=0 TRITON_INTERPRET=1 profuse step --out 'my dir'"
    assert prov["started_utc"] == "2026-12-07T04:00:00Z" and prov["ended_utc"].endswith("Z")


def test_write_result_adds_provenance_once_and_leaves_other_data_alone(tmp_path, fresh):
    files.mark_run(["sweep", "--rows", "64"])
    path = files.write_result(tmp_path / "r.json", {"kind": "sweep", "runs": []})
    saved = json.loads(path.read_text())
    prov = saved["provenance"]
    assert prov["command"]["profuse_args"] == ["sweep", "--rows", "64"]
    assert set(prov) >= {"source", "versions", "card", "host", "command", "started_utc", "ended_utc"}
    kept = files.with_provenance(saved)
    assert kept is saved  # a sweep's JSON and CSV share one provenance
    assert files.with_provenance([1, 2]) == [1, 2]


def test_a_saved_sweep_carries_provenance_in_its_json_and_csv(saved):
    out, _ = saved["a"]
    data = json.loads((out / "results.json").read_text())
    prov = data["provenance"]
    assert prov["command"]["profuse_args"][0] == "sweep" and prov["versions"]["torch"] == torch.__version__
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and all(r["started_utc"] == prov["started_utc"] for r in rows)
    assert all(r["torch"] == torch.__version__ for r in rows)


def test_report_prints_the_block_and_an_old_file_says_none_was_recorded(saved, tmp_path):
    out, _ = saved["a"]
    code, stdout, _ = run_cli("report", str(out / "results.json"))
    assert code == 0
    block = stdout[stdout.index("provenance:") :]
    assert "profuse sweep --rows 64,128" in block
    for line in ("source: ", "versions: python ", "card: ", "command: ", "run: "):
        assert f"  {line}" in block, block
    old = json.loads((out / "results.json").read_text())
    del old["provenance"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    code, stdout, _ = run_cli("report", str(tmp_path / "old.json"))
    assert code == 0 and P.NONE_RECORDED in stdout


def test_diff_says_each_field_the_runs_differ_in(saved, tmp_path):
    a = json.loads((saved["a"][0] / "results.json").read_text())
    b = json.loads((saved["b"][0] / "results.json").read_text())
    b["provenance"]["versions"]["torch"] = "9.0.0"
    b["provenance"]["source"]["dirty"] = not a["provenance"]["source"]["dirty"]
    b["provenance"]["command"]["argv"] = a["provenance"]["command"]["argv"]
    b["provenance"]["command"]["profuse_args"] = a["provenance"]["command"]["profuse_args"]
    lines = P.provenance_diff(a, b)
    assert "they differ in 2 fields" in lines[0]
    assert any(line.strip().startswith("versions.torch: ") and "9.0.0 (B)" in line for line in lines)
    assert any(line.strip().startswith("source.dirty: ") for line in lines)
    assert not any("started_utc" in line for line in lines[1:])  # the times are said in the head
    same = P.provenance_diff(a, {**a})
    assert len(same) == 1 and same[0].endswith("the same in every other field")
    del b["provenance"]
    (tmp_path / "b.json").write_text(json.dumps(b))
    code, stdout, _ = run_cli("diff", str(saved["a"][0] / "results.json"), str(tmp_path / "b.json"))
    assert code == 0 and "B recorded none" in stdout


def test_provenance_columns_of_a_file_without_one_are_empty(saved):
    data = json.loads((saved["a"][0] / "results.json").read_text())
    del data["provenance"]
    rows = R.csv_rows(data)
    assert rows and all(r[c] == "" for r in rows for c in R.PROVENANCE_CSV)
