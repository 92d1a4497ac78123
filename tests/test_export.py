"""hpcbert export and the final model (RUN_DIR/model): transformers loads what hpcbert writes and
gives the same outputs (within 1e-4) with the right labels; a checkpoint exports the same bytes as
the final model; tied weights are saved once; the tokenizer files tokenise as hpcbert does; an
exported model fine-tunes again."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import ROOT
from own_fixtures import FORMATS, MAX_LEN, write_data, write_model
from hpcbert import export
from hpcbert.cli import main
from hpcbert.model import BertConfig, BertForSequenceClassification, BertHeadModel, hf_state_dict
from hpcbert.runfiles import read_summary

transformers = pytest.importorskip("transformers")
CHINESE = ROOT.parent / "shared" / "data" / "chinese"
TINY = BertConfig(vocab_size=90, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                  max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, TINY.vocab_size, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # padded
    types = torch.zeros_like(ids)
    types[:, 5:] = 1
    return ids, mask, types


def _trained_like(model: torch.nn.Module) -> torch.nn.Module:
    """Perturb every parameter (biases and LayerNorms too), so a name mapped wrongly shows."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.mark.parametrize("num_labels, extra", [
    (3, {"id2label": {"0": "contradiction", "1": "entailment", "2": "neutral"},
         "label2id": {"contradiction": 0, "entailment": 1, "neutral": 2}}),
    (1, {"problem_type": "regression"}),
])
def test_a_classifier_round_trips_through_transformers(tmp_path, num_labels, extra):
    ours = _trained_like(BertForSequenceClassification(BertConfig(**{**TINY.to_dict(), "num_labels": num_labels})))
    out = export.write_hf_dir(tmp_path / "hf", ours, {"architectures": ["BertForSequenceClassification"], **extra}, None)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
    assert type(hf).__name__ == "BertForSequenceClassification" and hf.config.num_labels == num_labels
    if num_labels > 1:
        assert hf.config.id2label == {0: "contradiction", 1: "entailment", 2: "neutral"}
    else:
        assert hf.config.problem_type == "regression"
    ids, mask, types = _inputs()
    with torch.no_grad():
        a = ours(ids, mask, types)
        b = hf(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
    assert (a - b).abs().max() <= 1e-4


class _TiedLM(BertHeadModel):
    """A head whose decoder shares the word embeddings (as a masked-LM head does)."""
    _tied_weights_keys = ["cls.predictions.decoder.weight"]

    def __init__(self, c):
        super().__init__(c, with_pooler=False)
        self.cls = torch.nn.Module()
        self.cls.predictions = torch.nn.Module()
        self.cls.predictions.decoder = torch.nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight


def test_tied_weights_are_saved_once_under_the_name_hf_keeps(tmp_path):
    from safetensors.torch import load_file

    m = _TiedLM(TINY)
    sd = hf_state_dict(m)
    assert "bert.embeddings.word_embeddings.weight" in sd and "cls.predictions.decoder.weight" not in sd
    # every tensor under HF's names (fused Q/K/V as query/key/value), the tied decoder once
    n_layers = len(m.bert.encoder.layer)
    assert len(sd) == len(m.state_dict()) + 4 * n_layers - 1
    out = export.write_hf_dir(tmp_path / "hf", m, {"architectures": ["BertForMaskedLM"]}, None)
    saved = load_file(str(out / "model.safetensors"))
    assert set(saved) == set(sd) and torch.equal(saved["bert.embeddings.word_embeddings.weight"],
                                                 m.bert.embeddings.word_embeddings.weight)


@pytest.mark.slow
def test_export_of_a_classify_run_and_fine_tuning_the_export(tmp_path, capsys):
    """Train a classifier with checkpoints; `hpcbert export` gives a directory transformers loads
    with the run's labels and the trained model's logits; the newest checkpoint exports the same
    weights; `hpcbert train --model EXPORTED` loads every weight and fine-tunes it."""
    model_dir = write_model(tmp_path / "tiny")
    files = write_data(tmp_path / "data", "pairs", n_train=24, n_dev=8, n_test=2)
    _, text_fields, label = FORMATS["pairs"]
    common = ["--task", "classify", "--train-file", files["train"], "--dev-file", files["dev"],
              "--text-fields", text_fields, "--max-seq-length", MAX_LEN, "--batch-size", 8, "--threads", 1]
    run = tmp_path / "run"
    assert main(["train", *map(str, common), "--model", str(model_dir), "--max-steps", "4", "--lr", "1e-3",
                 "--checkpoint-steps", "4", "--out", str(run)]) == 0
    assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 0
    assert main(["export", str(run / "checkpoints" / "step-00000004"), "--out", str(tmp_path / "hf-ck")]) == 0
    assert "exported model" in capsys.readouterr().out
    for name in ("config.json", "vocab.txt", "tokenizer_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (tmp_path / "hf-ck" / name).read_bytes()
    from safetensors.torch import load_file
    final, ck = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("hf", "hf-ck"))
    assert final.keys() == ck.keys() and all(torch.equal(final[k], ck[k]) for k in final)

    # The trained weights, as the checkpoint holds them under hpcbert's names
    shared = torch.load(run / "checkpoints" / "step-00000004" / "shared.pt", weights_only=False)
    ours = BertForSequenceClassification(BertConfig(**shared["model_config"]))
    ours.load_state_dict(shared["model"])
    ours.eval()
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "hf")).eval()
    assert hf.config.id2label == {0: "neg", 1: "pos"} and hf.config.label2id == {"neg": 0, "pos": 1}
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    enc = tok(["the film was good, it", "a plot is awful"], ["this", '"it" was'], padding=True, return_tensors="pt")
    with torch.no_grad():
        a = ours(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"])
        b = hf(**enc).logits
    assert (a - b).abs().max() <= 1e-4

    # A newer checkpoint than the final model (a run resumed and stopped again) is what gets exported
    export.write_hf_dir(run / "model", ours, shared["hf_config"], model_dir, step=2)
    assert export.locate(run) == ("checkpoint", run / "checkpoints" / "step-00000004")

    # Fine-tune the export: every weight loads (nothing freshly initialised), not random
    again = tmp_path / "again"
    assert main(["train", *map(str, common), "--model", str(tmp_path / "hf"), "--max-steps", "2",
                 "--out", str(again)]) == 0
    err = capsys.readouterr().err
    assert "RANDOM" not in err and "freshly initialised" not in err and "ignored checkpoint tensors" not in err
    assert read_summary(again)["model_is_random"] is False


def test_export_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    for args, words in (([tmp_path / "run", "--out", tmp_path / "o"], "no final model"),
                        ([tmp_path / "nope", "--out", tmp_path / "o"], "no such directory"),
                        ([tmp_path / "run", "--out", tmp_path / "full"], "exists and is not an empty directory")):
        assert main(["export", *map(str, args)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("hpcbert export: error: ") and words in err and "\n" not in err


def test_exported_tokenizer_tokenises_as_hpcbert(tmp_path):
    """The cased Chinese vocabulary (do_lower_case false): transformers, loading the exported
    files, gives hpcbert's ids (without do_lower_case it would lower-case 'XP' and 'iPhone')."""
    src = CHINESE / "bert-base-chinese"
    if not (src / "vocab.txt").is_file():
        pytest.skip(f"bert-base-chinese vocabulary not found at {src}")
    from hpcbert.data.features import load_tokenizer

    import shutil

    texts = ["酒店环境很好，XP系统！", "iPhone 手机 Café ＡＢＣ", "混合English和中文123abc"]
    only_json = tmp_path / "only-json"  # no tokenizer_config.json: the case is in tokenizer.json alone
    only_json.mkdir()
    shutil.copyfile(src / "tokenizer.json", only_json / "tokenizer.json")
    for source in (only_json, src / "vocab.txt"):
        dest = tmp_path / f"out-{source.name}"
        dest.mkdir()
        export._copy_tokenizer(source, dest, 512)
        assert json.loads((dest / "tokenizer_config.json").read_text())["do_lower_case"] is False
        hf = transformers.AutoTokenizer.from_pretrained(str(dest))
        assert hf(texts)["input_ids"] == [e.ids for e in load_tokenizer(src, 512).encode_batch(texts)]
