"""A fused model under the code people fine-tune with, end to end on the CPU: transformers'
Trainer, TRL's SFTTrainer and generate, each against an unfused copy from the same weights.

    Trainer (default arguments, a dataset with a column the model does not take): train with
    gradient accumulation, evaluate with compute_metrics, predict; label smoothing; bf16
        -> the same logged losses, eval_loss and metrics, predictions and label_ids, weights
    SFTTrainer (its defaults: mean_token_accuracy logged; packing; a prompt-completion dataset,
    whose loss is the completion's; use_liger_kernel off, its default)
        -> the same logged losses, token accuracy and entropy, weights
    generate: greedy, beam search, sampling from a seed, a padded batch with and without the mask
        -> the same tokens

The fused models run HF_EAGER, the model's own math in the fused structure (the layers' pairs,
the rebuilt attention, the head's linear_cross_entropy with its logits policy), so every
comparison is exact and cheap: what these tests check is the plumbing (columns kept, labels
found, logits where the code reads them, masks and positions inferred). The Triton kernels'
numerics in training are tests/test_fusion_hf*.py's; through the interpreter, one Trainer run
here took 45-60 s on 2 cores, past this file's budget.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from fusion_cases import VOCAB, tiny, tokens  # noqa: E402

from profuse import fusion  # noqa: E402
from profuse.fusion import fuse  # noqa: E402

SEQ = 12


def _pair(arch: str = "llama", seed: int = 301, **overrides):
    """(unfused, fused): the same weights."""
    model = tiny(arch, seed=seed, layers=2, **overrides)
    return model, copy.deepcopy(model)


def _args(tmp_path, name: str, cls=None, **kwargs):
    cls = cls or transformers.TrainingArguments
    base = dict(
        output_dir=str(tmp_path / name),
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        learning_rate=3e-3,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        max_steps=2,
        seed=5,
        disable_tqdm=True,
    )
    return cls(**{**base, **kwargs})


def _same_weights(a, b) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def _logged(history: list[dict], keys: tuple[str, ...]) -> list[dict]:
    return [{k: v for k, v in entry.items() if k in keys} for entry in history]


def _lm_dataset(seed: int, rows: int) -> datasets.Dataset:
    ids = tokens(seed, batch=rows, seq=SEQ)
    labels = ids.clone()
    labels[:, :3] = -100  # a prompt the loss skips
    return datasets.Dataset.from_dict(
        {
            "input_ids": ids.tolist(),
            "attention_mask": torch.ones_like(ids).tolist(),
            "labels": labels.tolist(),
            "text": [f"row {i}" for i in range(rows)],  # not a forward argument: Trainer drops it
        }
    )


def _top1(pred) -> dict:
    """compute_metrics: next-token accuracy over the labelled tokens (label_ids must be there)."""
    assert pred.label_ids is not None
    logits, labels = pred.predictions, pred.label_ids
    hit = logits[:, :-1].argmax(-1) == labels[:, 1:]
    keep = labels[:, 1:] != -100
    return {"top1": float((hit & keep).sum() / keep.sum())}


# --------------------------------------------------------------------------------------------
# transformers.Trainer
# --------------------------------------------------------------------------------------------


def _trainer_run(model, tmp_path, name, **kwargs):
    train, held_out = _lm_dataset(311, 8), _lm_dataset(312, 4)
    args = _args(tmp_path, name, gradient_accumulation_steps=2, **kwargs)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=train, eval_dataset=held_out, compute_metrics=_top1
    )
    trainer.train()
    metrics = trainer.evaluate()
    prediction = trainer.predict(held_out)
    return trainer.state.log_history, metrics, prediction


TRAINER_CASES = {
    "default": {},
    "label-smoothing": {"label_smoothing_factor": 0.1},
    "bf16": {"bf16": True},  # autocast, and accelerate's casts of the outputs to fp32
}


@pytest.mark.parametrize("case", list(TRAINER_CASES))
def test_trainer_trains_evaluates_and_predicts_as_unfused(tmp_path, case):
    unfused, fused = _pair(seed=302)
    fuse(fused, fusion.HF_EAGER)
    want = _trainer_run(unfused, tmp_path, "unfused", **TRAINER_CASES[case])
    got = _trainer_run(fused, tmp_path, "fused", **TRAINER_CASES[case])
    keys = ("loss", "eval_loss", "eval_top1", "grad_norm", "step")
    (history, metrics, prediction), (want_history, want_metrics, want_prediction) = got, want
    assert "eval_loss" in metrics and "eval_top1" in metrics  # issue 51, point 2
    assert sum("loss" in entry for entry in history) == 2  # two steps of two micro-batches each
    assert len(history) == len(want_history)
    assert _logged(history, keys) == _logged(want_history, keys)
    assert {k: metrics[k] for k in ("eval_loss", "eval_top1")} == {
        k: want_metrics[k] for k in ("eval_loss", "eval_top1")
    }
    assert prediction.label_ids is not None and (prediction.label_ids == want_prediction.label_ids).all()
    assert (prediction.predictions == want_prediction.predictions).all()
    _same_weights(fused, unfused)


# --------------------------------------------------------------------------------------------
# TRL's SFTTrainer
# --------------------------------------------------------------------------------------------


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(VOCAB - 3)}
    words.update({"<unk>": VOCAB - 3, "<pad>": VOCAB - 2, "<eos>": VOCAB - 1})
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )


def _sentences(seed: int, rows: int, low: int, high: int) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (rows,), generator=gen)
    return [" ".join(f"w{int(t)}" for t in torch.randint(0, VOCAB - 3, (n,), generator=gen)) for n in lengths]


SFT_CASES = {
    "defaults": lambda: (datasets.Dataset.from_dict({"text": _sentences(321, 8, 5, 14)}), {}),
    "packing": lambda: (datasets.Dataset.from_dict({"text": _sentences(322, 8, 3, 9)}), {"packing": True}),
    "completion-only": lambda: (
        datasets.Dataset.from_dict(
            {"prompt": _sentences(323, 8, 2, 6), "completion": _sentences(324, 8, 2, 6)}
        ),
        {},
    ),
}


@pytest.mark.parametrize("case", list(SFT_CASES))
def test_sft_trainer_trains_as_unfused(tmp_path, case):
    trl = pytest.importorskip("trl")
    unfused, fused = _pair(seed=303, pad_token_id=VOCAB - 2, eos_token_id=VOCAB - 1)
    fuse(fused, fusion.HF_EAGER)
    runs = []
    for name, model in (("unfused", unfused), ("fused", fused)):
        data, options = SFT_CASES[case]()
        args = _args(tmp_path, name, cls=trl.SFTConfig, max_length=16, use_liger_kernel=False, **options)
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=_tokenizer())
        trainer.train()
        runs.append(trainer.state.log_history)
    want, got = runs
    keys = ("loss", "mean_token_accuracy", "entropy", "num_tokens", "grad_norm")
    assert sum("mean_token_accuracy" in entry and "loss" in entry for entry in got) == 2
    assert _logged(got, keys) == _logged(want, keys)
    _same_weights(fused, unfused)


# --------------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------------

PAD = 0

GENERATE_CASES = {
    "greedy": {"do_sample": False},
    "beams": {"do_sample": False, "num_beams": 3},
    "sampling": {"do_sample": True, "top_k": 20, "temperature": 0.9},
    "padded-with-mask": {"do_sample": False, "mask": True},
    "padded-without-mask": {"do_sample": False},
}


@pytest.mark.parametrize("case", list(GENERATE_CASES))
def test_generate_gives_the_unfused_tokens(case):
    unfused, fused = _pair("qwen3", seed=304, pad_token_id=PAD)
    fuse(fused, fusion.HF_EAGER)
    options = dict(GENERATE_CASES[case])
    ids = tokens(305, batch=3, seq=6)
    ids[ids == PAD] = PAD + 1
    if case.startswith("padded"):
        ids[0, :2] = PAD
        ids[2, :4] = PAD
    if options.pop("mask", False):
        options["attention_mask"] = (ids != PAD).long()
    out = []
    for model in (unfused.eval(), fused.eval()):
        torch.manual_seed(306)
        out.append(model.generate(ids, max_new_tokens=5, pad_token_id=PAD, **options))
    assert out[0].shape == (3, 6 + 5) and torch.equal(out[1], out[0])
