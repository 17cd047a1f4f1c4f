"""Train the small byte-level BPE shipped in pjax/assets/data/tokenizer/bpe4096 from the shipped text.

    python -m pjax.assets.train_bpe  [--vocab 4096] [--text FILE] [--out DIR]

By default it reads the shipped book and rewrites the shipped tokenizer (in a clone: the
repository's file; the run is deterministic, so it reproduces that file byte for byte).

A 4,096-token vocabulary keeps the output layer of the tiny CPU models (debug, picotron-cpu) from
dominating their step time; GPT-2's 50,257-token BPE would make it ~90% of the work.
"""
import argparse
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pjax.assets import ROOT


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--text", default=str(ROOT / "data" / "prideprejudice.txt"))
    ap.add_argument("--out", default=str(ROOT / "data" / "tokenizer" / "bpe4096"))
    args = ap.parse_args()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([args.text], trainer)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    tok.save(str(Path(args.out) / "tokenizer.json"))
    print(f"wrote {args.out}/tokenizer.json with {tok.get_vocab_size()} tokens")


if __name__ == "__main__":
    main()
