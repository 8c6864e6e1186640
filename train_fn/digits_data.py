"""The digits example's data and model, shared by the training function (``train_fn.digits``) and the
``accelerate launch`` script (``train_fn/digits_script.py``). Imports nothing from raylaunch or Ray.

scikit-learn's 8x8 digits (1,797 images, shipped with the package) are read as 64-token
sequences: each pixel's intensity 0..16 is a token, after a [CLS] token whose final state
classifies the image. The model is a small BERT built from a config, so nothing is downloaded;
``name_or_path`` loads a saved or hub model with ``from_pretrained`` instead.
"""

from __future__ import annotations

import hashlib

import torch
from torch.utils.data import Dataset

__all__ = ["CLS", "NUM_LABELS", "Digits", "build_model", "evaluate", "load_data", "weights_digest"]

CLS = 17  # pixel intensities are the tokens 0..16
NUM_LABELS = 10


class Digits(Dataset):
    """(tokens, label, index) for each image; the index lets tests see the sharding."""

    def __init__(self, images, labels) -> None:
        tokens = torch.as_tensor(images, dtype=torch.long)
        self.tokens = torch.cat([torch.full((len(tokens), 1), CLS), tokens], dim=1)
        self.labels = torch.as_tensor(labels, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i], "labels": self.labels[i], "index": i}


def load_data(train_samples: int | None):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data, digits.target, test_size=0.2, random_state=0, stratify=digits.target
    )
    if train_samples:
        x_train, y_train = x_train[:train_samples], y_train[:train_samples]
    return Digits(x_train, y_train), Digits(x_test, y_test)


def build_model(cfg: dict):
    from transformers import BertConfig, BertForSequenceClassification

    if cfg["name_or_path"]:
        # The real hub path: a local folder written by save_pretrained, or a hub id.
        return BertForSequenceClassification.from_pretrained(cfg["name_or_path"], num_labels=NUM_LABELS)
    config = BertConfig(
        vocab_size=CLS + 1,
        hidden_size=cfg["hidden_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        intermediate_size=cfg["intermediate_size"],
        max_position_embeddings=80,
        hidden_dropout_prob=cfg["dropout"],
        initializer_range=cfg["initializer_range"],
        attention_probs_dropout_prob=cfg["dropout"],
        num_labels=NUM_LABELS,
    )
    return BertForSequenceClassification(config)


def weights_digest(state_dict: dict) -> str:
    """A short fingerprint of every weight, to compare runs exactly.

    Give it ``accelerator.get_state_dict(model)`` on every rank: with FSDP that gathers the
    shards (a collective), and only the main process gets the weights.
    """
    h = hashlib.sha256()
    for name, p in sorted(state_dict.items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def evaluate(accelerator, model, test_dl, step: int) -> float:
    """Accuracy on the held-out images, logged at ``step``; gather_for_metrics drops even_batches' repeats."""
    model.eval()
    correct = total = 0
    for batch in test_dl:
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"]).logits
        preds, labels = accelerator.gather_for_metrics((logits.argmax(-1), batch["labels"]))
        correct += (preds == labels).sum().item()
        total += labels.numel()
    accuracy = correct / total
    accelerator.log({"eval_accuracy": accuracy}, step=step)
    accelerator.print(f"eval accuracy {accuracy:.4f} on {total} held-out images")
    return accuracy
