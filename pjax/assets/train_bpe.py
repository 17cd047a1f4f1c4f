"""Train the small byte-level BPE shipped in pjax/assets/data/tokenizer/bpe4096 from the shipped text.

    python -m pjax.assets.train_bpe  [--vocab 4096] [--text FILE] [--out DIR]

By default it rewrites the shipped tokenizer from the shipped book, byte for byte (deterministic).
Why 4,096 tokens: ARCHITECTURE.md, "Small shipped tokenizer".
"""
import argparse
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pjax.assets import ROOT


def parser() -> argparse.ArgumentParser:
    """The command line's parser (tests/test_docs.py parses the commands the docs show with it)."""
    ap = argparse.ArgumentParser(prog="python -m pjax.assets.train_bpe", description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--text", default=str(ROOT / "data" / "prideprejudice.txt"))
    ap.add_argument("--out", default=str(ROOT / "data" / "tokenizer" / "bpe4096"))
    return ap


def main() -> None:
    args = parser().parse_args()
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
