"""A transformers Trainer script in the shape of transformers' examples (run_clm.py): HfArgumentParser over its
own dataclass and TrainingArguments, a model from a config, `trainer.train(resume_from_checkpoint=...)`.

A 2-layer GPT-2 with dropout, on token sequences made here (no hub). Ends by writing `final.json` into the output
folder: the sha256 of every final weight and the Trainer's global step (what the tests compare across launchers).
"""

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field

import torch
from transformers import (GPT2Config, GPT2LMHeadModel, HfArgumentParser, Seq2SeqTrainingArguments, Trainer,
                          TrainerCallback, set_seed)


@dataclass
class ModelArguments:
    n_layer: int = field(default=2)
    dropout: float = field(default=0.1)
    samples: int = field(default=64)
    seq_len: int = field(default=16)
    trainer_class: str = field(default="Trainer", metadata={"help": "Trainer or Seq2SeqTrainer"})
    throttle_s: float = field(default=0.0, metadata={"help": "sleep after each step (tests: time to act mid-run)"})


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq_len: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 64, (n, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Throttle(TrainerCallback):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.seconds)


def main(argv: list[str] | None = None, resume: str | None = None) -> dict:
    """The script; a function calls it with its arguments and the folder to resume from."""
    # Seq2SeqTrainingArguments: TrainingArguments and the fields Seq2SeqTrainer reads (the same for a Trainer)
    parser = HfArgumentParser((ModelArguments, Seq2SeqTrainingArguments))
    model_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    if resume is not None:
        training_args.resume_from_checkpoint = resume
    set_seed(training_args.seed)
    config = GPT2Config(vocab_size=64, n_positions=model_args.seq_len, n_embd=32, n_layer=model_args.n_layer,
                        n_head=2, resid_pdrop=model_args.dropout, embd_pdrop=model_args.dropout,
                        attn_pdrop=model_args.dropout)
    model = GPT2LMHeadModel(config)
    cls = Trainer
    if model_args.trainer_class == "Seq2SeqTrainer":
        from transformers import Seq2SeqTrainer as cls
    trainer = cls(model=model, args=training_args,
                  train_dataset=Tokens(model_args.samples, model_args.seq_len, 1),
                  eval_dataset=Tokens(8, model_args.seq_len, 2),
                  callbacks=[Throttle(model_args.throttle_s)] if model_args.throttle_s else None)
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model()
    trainer.log_metrics("train", result.metrics)
    weights = {k: hashlib.sha256(v.detach().contiguous().numpy().tobytes()).hexdigest()
               for k, v in trainer.model.state_dict().items()}
    out = {"weights": weights, "global_step": trainer.state.global_step, "world_size": training_args.world_size,
           "accumulation": training_args.gradient_accumulation_steps}
    if trainer.is_world_process_zero():
        with open(os.path.join(training_args.output_dir, "final.json"), "w") as f:
            json.dump(out, f)
    return out


if __name__ == "__main__":
    main()
    if os.environ.get("TRAINER_SCRIPT_EXIT_NOW"):
        # Under accelerate launch (the tests' peer run): end as raylaunch's ranks end, before the interpreter's
        # finalization, where gloo's threads abort a process now and then ("terminate called without an active
        # exception", pytorch/pytorch#179291; bench/results-exits.md). Everything compared is written by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
