"""`profuse fuse`: every causal-LM family as a tiny model, what fuse does to it, checked."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

pytest.importorskip("transformers")

from profuse import coverage as C  # noqa: E402
from profuse import fusion  # noqa: E402
from profuse.cli import main  # noqa: E402
from profuse.errors import UsageError  # noqa: E402
from profuse.models import hf_families  # noqa: E402


def test_families_are_the_causal_lm_model_types():
    names = hf_families.families()
    assert {"llama", "qwen3", "gemma3_text", "mixtral"} <= set(names)
    assert list(names) == sorted(names)


def test_shrink_sets_every_size_field_it_knows_and_keeps_token_ids_inside_the_vocabulary():
    fields = {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "vocab_size": 128256,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008],
        "pad_token_id": None,
        "layer_types": ["full_attention"] * 32,
        "rope_theta": 500000.0,
        "text_config": {"hidden_size": 2048, "intermediate_size": 8192, "model_type": "x"},
    }
    out = hf_families.shrink(fields)
    tiny = hf_families.TINY_SIZES
    assert out["hidden_size"] == tiny["hidden_size"] and out["num_hidden_layers"] == tiny["num_hidden_layers"]
    vocab = tiny["vocab_size"]
    assert out["bos_token_id"] < vocab and all(t < vocab for t in out["eos_token_id"])
    assert out["pad_token_id"] is None
    assert out["layer_types"] == ["full_attention"] * tiny["num_hidden_layers"]
    assert "rope_theta" not in out  # not a size: the family's own value stays
    assert out["text_config"]["hidden_size"] == tiny["hidden_size"]
    assert out["text_config"]["model_type"] == "x"


def test_a_llama_fuses_every_op_and_the_check_passes():
    row = C.family_coverage("llama")
    assert row.status == "fused", row
    every = {"silu_mul": 2, "add_rms_norm": 4, "rms_norm": 1, "rope": 2, "linear_cross_entropy": 1}
    assert row.counts == every
    assert row.left_unfused == []
    assert row.params < hf_families.MAX_TINY_PARAMS
    assert row.passed and set(row.check) == {"loss", "gradients", "logits"}


def test_a_wrong_op_fails_the_check(monkeypatch):
    """The check compares numbers: an op that computes something else is caught."""
    eager = fusion.EAGER

    def wrong_silu_mul(gate, up=None):
        return eager.silu_mul(gate, up) * 1.001 if up is not None else eager.silu_mul(gate) * 1.001

    broken = dataclasses.replace(eager, silu_mul=wrong_silu_mul, name="broken")
    row = C.family_coverage("llama", impl=broken)
    assert row.status == "check failed"
    assert row.check["loss"] > C.CHECK_TOLERANCE or row.check["logits"] > C.CHECK_TOLERANCE


def test_a_model_without_a_decoder_stack_is_refused_in_one_line():
    row = C.family_coverage("bert", dry_run=True)
    assert row.status == "refused"
    assert "\n" not in row.refused and "BertLMHeadModel: no decoder stack" in row.refused
    assert row.check is None


def test_dry_run_changes_nothing_and_checks_nothing():
    cov = C.coverage(["qwen3"], dry_run=True)
    (row,) = cov.rows
    assert row.counts.get("qk_norm_rope") == 2 and row.check is None and cov.dry_run


def test_unknown_families_are_one_usage_error_before_any_work():
    with pytest.raises(UsageError, match="nope"):
        C.coverage(["llama", "nope"])


def test_fuse_command_writes_the_table_and_json(tmp_path, capsys):
    rc = main(["fuse", "--model", "hf:llama,bert", "--dry-run", "--out", str(tmp_path)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "llama" in text and "refused" in text
    data = json.loads((tmp_path / "coverage.json").read_text())
    assert [f["family"] for f in data["families"]] == ["llama", "bert"]
    assert data["families"][1]["status"] == "refused"
    assert data["provenance"]["command"]["profuse_args"][0] == "fuse"  # files.write_result
    md = (tmp_path / "coverage.md").read_text()
    assert md.startswith("| family |") and "| llama | LlamaForCausalLM | fused |" in md


def test_fuse_command_takes_a_config_file(tmp_path, capsys):
    import transformers

    config = transformers.Qwen3Config(hidden_size=4096, num_hidden_layers=40, vocab_size=151936)
    path = tmp_path / "config.json"
    path.write_text(config.to_json_string())
    assert main(["fuse", "--hf-config", str(path), "--dry-run"]) == 0
    assert "qk_norm_rope x2" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, says",
    [
        (["fuse", "--model", "gpt"], "hf:FAMILY"),
        (["fuse", "--model", "hf:llama,"], "empty family"),
        (["fuse", "--model", "hf:nope"], "nope"),
    ],
)
def test_fuse_command_bad_input_is_one_line(argv, says, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1


def test_a_config_files_layout_survives_the_shrinking_and_its_sizes_do_not():
    """--hf-config: the file's activation and MoE layout are the tiny model's, its sizes tiny."""
    fields = {"model_type": "llama4_text", "moe_layers": [], "hidden_act": "gelu", "hidden_size": 5120,
              "num_hidden_layers": 48, "intermediate_size_mlp": 16384}  # fmt: skip
    config = hf_families.tiny_config("llama4_text", fields)
    assert (config.moe_layers, config.hidden_act) == ([], "gelu")
    assert config.hidden_size == hf_families.TINY_SIZES["hidden_size"] and config.num_hidden_layers <= 4
    model = hf_families.build_tiny(config)
    assert type(model.model.layers[0].feed_forward).__name__ == "Llama4TextMLP"


def test_the_check_tells_two_different_models_apart():
    model = hf_families.build_tiny(hf_families.tiny_config("llama"))
    other = hf_families.build_tiny(hf_families.tiny_config("llama"), seed=1)
    errs = C.check_fused(model, other, vocab=hf_families.TINY_SIZES["vocab_size"])
    assert all(v > C.CHECK_TOLERANCE for v in errs.values())
    assert torch.isfinite(torch.tensor(list(errs.values()))).all()


def test_a_tiny_model_that_does_not_run_unfused_is_not_checked_rather_than_failed(monkeypatch):
    """A shrunk config whose own step raises says so; it is no failure of the fusion."""

    def broken(model, ids, labels, seed):
        if not any(getattr(type(m), "_profuse_fused", False) for m in model.modules()):
            raise RuntimeError("The size of tensor a (4) must match the size of tensor b (8)")
        return C.__dict__["_run_unpatched"](model, ids, labels, seed)

    monkeypatch.setitem(C.__dict__, "_run_unpatched", C._run)
    monkeypatch.setattr(C, "_run", broken)
    row = C.family_coverage("llama")
    assert row.status == "not checked" and row.check is None and row.check_error is None
    assert "unfused tiny model's own step fails" in row.unchecked and "tensor a (4)" in row.unchecked
