"""``liveshard prepare-data``: tokenize text files into Megatron's indexed format (.bin/.idx).

    liveshard prepare-data --input data/*.jsonl --tokenizer tok/ --output-prefix data/train_text_document \\
        --append-eod --workers 8

The dataset is then named by its prefix (``data/train_text_document``) wherever Megatron takes a
data path. Input formats and guarantees: ``liveshard.runtime.data.prepare``.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from liveshard.runtime.errors import ConfigError

TOKENIZER_TYPES = ("huggingface", "sentencepiece")


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", required=True, nargs="+", metavar="FILE",
                   help="JSON lines (.jsonl/.json, one object per line) or plain text (one document per "
                        "blank-line-separated paragraph); .gz accepted")
    p.add_argument("--tokenizer", required=True, metavar="DIR_OR_FILE",
                   help="a directory holding a Hugging Face tokenizer.json (or the file), or a SentencePiece .model")
    p.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                   help="default: sentencepiece for a .model path, else huggingface")
    p.add_argument("--output-prefix", required=True, metavar="PREFIX",
                   help="writes PREFIX.bin and PREFIX.idx (directories are created)")
    p.add_argument("--json-key", default="text", help="the key holding each document's text (default: text)")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes, one core each (default: 1)")
    p.add_argument("--append-eod", action="store_true",
                   help="end every document with the tokenizer's end-of-document id (usual for GPT pretraining)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    # Imported here: megatron-core and torch take seconds, which --help should not pay.
    with warnings.catch_warnings():
        # megatron-core warns at import that Apex / TransformerEngine kernels are missing: a
        # training matter, noise in a tokenizing run.
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        from liveshard.runtime.data.prepare import prepare
        from liveshard.runtime.data.tokenizer import default_kind, load_tokenizer

    kind = args.tokenizer_type or default_kind(args.tokenizer)
    try:
        tokenizer = load_tokenizer(kind, args.tokenizer, field="tokenizer")
    except ConfigError as e:
        # load_tokenizer names spec fields (tokenizer.path / .type); here they are flags
        flag = "--tokenizer-type" if e.field.endswith(".type") else "--tokenizer"
        raise ConfigError(flag, e.problem, e.fix) from None
    try:
        summary = prepare(args.input, tokenizer, args.output_prefix, json_key=args.json_key,
                          workers=args.workers, append_eod=args.append_eod, progress=not args.no_progress)
    except KeyboardInterrupt:
        print("liveshard prepare-data: interrupted; nothing written", file=sys.stderr)
        return 130
    print(summary.describe())
    return 0
