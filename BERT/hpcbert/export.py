"""`hpcbert export RUN_DIR --out HF_DIR`: a run's model as a Hugging Face directory. One exporter
for every objective; what it knows of a task comes from the objective's `hf_config()`.

    HF_DIR/config.json              BertConfig's fields (HF key names), model_type "bert", and the
                                    objective's keys: architectures, id2label/label2id, problem_type ...
    HF_DIR/model.safetensors        the weights under HF names (model.hf_state_dict: tied weights once)
    HF_DIR/vocab.txt, tokenizer.json, special_tokens_map.json
                                    copied from the run's tokenizer (--tokenizer, else the model's own)
    HF_DIR/tokenizer_config.json    the source's, with do_lower_case, strip_accents and
                                    tokenize_chinese_chars set to what hpcbert's tokenizer does, so
                                    transformers tokenises exactly as the run did

`transformers` loads it (AutoModelForSequenceClassification / ...ForQuestionAnswering /
...ForPreTraining.from_pretrained(HF_DIR), AutoTokenizer.from_pretrained(HF_DIR)) and gives the
run's outputs; `hpcbert train --model HF_DIR` fine-tunes it further.

The weights come from the run's final model, RUN_DIR/model (written in this same layout at the end
of a run, --save-model), or from its newest complete checkpoint where that is newer (a run stopped
early, or resumed and stopped again). A checkpoint directory (RUN_DIR/checkpoints/step-N) may be
given instead of RUN_DIR. A checkpoint's model is rebuilt from the class of model.py that
hf_config()["architectures"][0] names (every head class is HF's name and takes a BertConfig).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

FINAL_MODEL = "model"  # RUN_DIR/model: the final weights, a Hugging Face directory
STEP_KEY = "hpcbert_step"  # model.safetensors metadata: the optimizer step the weights are from
_TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "special_tokens_map.json")


# --- writing ---------------------------------------------------------------------------------------

def hf_config(model_cfg: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """config.json: the model's BertConfig fields (already HF's key names) + the objective's keys."""
    cfg = {**model_cfg, "model_type": "bert", "position_embedding_type": "absolute", **extra}
    if "id2label" in cfg:
        cfg["num_labels"] = len(cfg["id2label"])
    return dict(sorted(cfg.items()))


def tokenizer_config(src: Path, max_length: int) -> dict[str, Any]:
    """The source's tokenizer_config.json (if any), with the normalisation hpcbert's tokenizer
    applies written out: transformers' BertTokenizer rebuilds its normaliser from these keys (and
    lower-cases by default), so without them an exported cased vocabulary would be lower-cased."""
    from .data.features import load_tokenizer

    cfg_file = (src if src.is_dir() else src.parent) / "tokenizer_config.json"
    base = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    norm = json.loads(load_tokenizer(src, max_length).to_str()).get("normalizer") or {}
    if norm.get("type") == "BertNormalizer":
        base.update(do_lower_case=norm["lowercase"], strip_accents=norm["strip_accents"],
                    tokenize_chinese_chars=norm["handle_chinese_chars"])
    base.setdefault("tokenizer_class", "BertTokenizer")
    base.setdefault("model_max_length", max_length)
    return base


def _copy_tokenizer(src: Path, dest: Path, max_length: int) -> None:
    if src.is_dir():
        for name in _TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, dest / name)
    elif src.is_file():  # --tokenizer FILE: a tokenizer.json or a vocab.txt under any name
        shutil.copyfile(src, dest / ("tokenizer.json" if src.suffix == ".json" else "vocab.txt"))
    else:
        raise ValueError(f"tokenizer: {src} does not exist; give the run's vocabulary with --tokenizer DIR")
    (dest / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(src, max_length), indent=2) + "\n")


def write_hf_dir(out: Path, model, extra: dict[str, Any], tokenizer: Path | None, step: int | None = None) -> Path:
    """Write `model` (an hpcbert head model) as a Hugging Face directory at `out`, atomically: built
    beside it under a hidden name, then renamed into place (a directory already at `out` is replaced)."""
    from safetensors.torch import save_file

    from .model import hf_state_dict

    out = Path(out)
    extra = {"architectures": [type(model).__name__], **extra}
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        meta = {"format": "pt", **({STEP_KEY: str(step)} if step is not None else {})}  # transformers needs "format"
        save_file(hf_state_dict(model), str(tmp / "model.safetensors"), metadata=meta)
        cfg = hf_config(model.config.to_dict(), extra)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        if tokenizer is not None:
            _copy_tokenizer(Path(tokenizer), tmp, model.config.max_position_embeddings)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# --- reading a run ---------------------------------------------------------------------------------

def model_step(model_dir: Path) -> int | None:
    """The step recorded in a final model's model.safetensors (None when absent)."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "np") as f:
        step = (f.metadata() or {}).get(STEP_KEY)
    return int(step) if step is not None and step.isdigit() else None


def locate(path: Path) -> tuple[str, Path]:
    """Where a run's newest weights are: ("model", RUN_DIR/model) or ("checkpoint", its directory).
    `path` is a run directory or a checkpoint directory; ValueError names what is missing."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: no such directory; give a run directory (hpcbert train --out) or a checkpoint "
                         f"directory (RUN_DIR/checkpoints/step-N)")
    if (path / "MANIFEST.json").is_file():
        return "checkpoint", path
    final = path / FINAL_MODEL
    has_final = (final / "config.json").is_file() and (final / "model.safetensors").is_file()
    ckpts = path / "checkpoints"
    newest = None
    if ckpts.is_dir():
        from .checkpoint import CheckpointManager

        newest = CheckpointManager(ckpts).latest()
    if has_final and (newest is None or (model_step(final) or 0) >= newest.step):
        return "model", final
    if newest is not None:
        return "checkpoint", newest.path
    raise ValueError(f"{path}: no final model ({final}) and no complete checkpoint in {ckpts}; a run writes its "
                     f"final model at the end (--save-model, the default) and checkpoints with "
                     f"--checkpoint-every / --checkpoint-steps or when stopped early")


def run_tokenizer(run_cfg: dict[str, Any]) -> Path | None:
    """The tokenizer a run used: its --tokenizer, else its model's own vocabulary."""
    if run_cfg.get("tokenizer"):
        return Path(run_cfg["tokenizer"])
    from . import zoo

    return zoo.resolve(run_cfg["model"]).vocab_dir


def model_from_checkpoint(ck_dir: Path):
    """(model with the checkpoint's weights, the objective's hf_config, the run's config, step)."""
    from . import model as model_module
    from .checkpoint import CheckpointManager

    import torch

    ck = CheckpointManager(ck_dir.parent).verify(ck_dir)  # manifest and checksums first
    shared = torch.load(ck.path / "shared.pt", map_location="cpu", weights_only=False)
    if "hf_config" not in shared or "model_config" not in shared:
        raise ValueError(f"{ck_dir}: written by an hpcbert that did not record the model's config in its "
                         f"checkpoints; export the run's final model ({FINAL_MODEL}/) instead")
    extra = shared["hf_config"]
    arch = (extra.get("architectures") or [None])[0]
    cls = getattr(model_module, str(arch), None)
    if not (isinstance(cls, type) and issubclass(cls, model_module.BertHeadModel)):
        raise ValueError(f"{ck_dir}: architecture {arch!r} is not a model of hpcbert.model")
    model = cls(model_module.BertConfig(**shared["model_config"]))
    model.load_state_dict(shared["model"])
    return model, extra, shared["config"], ck.step


def export(src: Path, out: Path, tokenizer: Path | None = None) -> str:
    """Export the newest weights of run (or checkpoint) `src` into `out` (which must not hold
    anything yet); returns a one-line description of what was exported."""
    src, out = Path(src), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"out: {out} exists and is not an empty directory; choose a new one")
    kind, where = locate(src)
    if kind == "model" and tokenizer is None:
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(where, tmp)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
        step = model_step(where)
    else:
        if kind == "model":  # another tokenizer: rebuild the directory around the same weights
            raise ValueError(f"tokenizer: {where} already holds the run's tokenizer; --tokenizer is for "
                             f"exporting a checkpoint whose run's vocabulary moved")
        model, extra, run_cfg, step = model_from_checkpoint(where)
        tok = tokenizer or run_tokenizer(run_cfg)
        if tok is not None and not tok.exists():
            raise ValueError(f"tokenizer: {tok} (the run's vocabulary) does not exist any more; pass --tokenizer DIR")
        write_hf_dir(out, model, extra, tok, step)
    return f"{kind} {where}" + (f" (step {step})" if step is not None else "")


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="hpcbert export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="a run directory (its final model, else its newest complete checkpoint) or "
                                   "a checkpoint directory")
    p.add_argument("--out", required=True, help="the Hugging Face directory to write (new or empty)")
    p.add_argument("--tokenizer", default=None,
                   help="checkpoints only: the run's vocabulary (directory or file), where it has moved since")
    a = p.parse_args(argv)
    try:
        what = export(Path(a.run_dir), Path(a.out), Path(a.tokenizer) if a.tokenizer else None)
    except (ValueError, FileNotFoundError) as e:
        if os.environ.get("HPCBERT_DEBUG"):
            raise
        print(f"hpcbert export: error: {e}", file=sys.stderr)
        return 2
    print(f"exported {what} to {a.out}")
    return 0
