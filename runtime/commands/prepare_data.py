"""``liveshard prepare-data``: tokenize text files into Megatron's indexed format (.bin/.idx).

    liveshard prepare-data --input data/*.jsonl --tokenizer tok/ --output-prefix data/train_text_document \\
        --append-eod --workers 8

The dataset is then named by its prefix (``data/train_text_document``) wherever Megatron takes a
data path. Input formats and guarantees: ``liveshard.runtime.data.prepare``.

    liveshard prepare-data --builtin-corpus [DIR]

builds the built-in corpus (``builtin:corpus/...`` in a job; ``liveshard.runtime.data.corpus``)
ahead of its first use, in DIR or where a job would look for it.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from liveshard.runtime.contract.env import Env
from liveshard.runtime.errors import ConfigError

TOKENIZER_TYPES = ("huggingface", "sentencepiece")


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--builtin-corpus", nargs="?", const="", default=None, metavar="DIR",
                   help="build the built-in corpus that jobs name builtin:corpus/... (default DIR: "
                        "$LIVESHARD_CORPUS, else ~/.cache/liveshard/corpus/v1024) instead of tokenizing --input")
    p.add_argument("--input", nargs="+", metavar="FILE",
                   help="JSON lines (.jsonl/.json, one object per line) or plain text (one document per "
                        "blank-line-separated paragraph); .gz accepted")
    p.add_argument("--tokenizer", metavar="DIR_OR_FILE",
                   help="a directory holding a Hugging Face tokenizer.json (or the file), or a SentencePiece .model")
    p.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                   help="default: sentencepiece for a .model path, else huggingface")
    p.add_argument("--output-prefix", metavar="PREFIX",
                   help="writes PREFIX.bin and PREFIX.idx (directories are created)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace PREFIX.bin and PREFIX.idx where they exist (default: refuse)")
    p.add_argument("--json-key", default="text", help="the key holding each document's text (default: text)")
    from liveshard.runtime.cli import alias

    p.add_argument("--jobs", dest="workers", type=int, default=1, metavar="N",
                   help="tokenizer processes, one core each (default: 1)")
    alias(p, "--jobs", "--workers")  # --workers/--procs: training processes elsewhere
    p.add_argument("--append-eod", action="store_true",
                   help="end every document with the tokenizer's end-of-document id (usual for GPT pretraining)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    if args.builtin_corpus is not None:
        return _builtin_corpus(args)
    for flag in ("input", "tokenizer", "output_prefix"):
        if not getattr(args, flag):
            name = "--" + flag.replace("_", "-")
            raise ConfigError(name, "is required", f"give {name}, or --builtin-corpus to build the built-in corpus")
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
                          workers=args.workers, append_eod=args.append_eod, progress=not args.no_progress,
                          overwrite=args.overwrite)
    except KeyboardInterrupt:
        print("liveshard prepare-data: interrupted; nothing written", file=sys.stderr)
        return 130
    print(summary.describe())
    return 0


def _builtin_corpus(args: argparse.Namespace) -> int:
    from liveshard.runtime.data.corpus import BUILTIN_VOCAB, build_corpus, builtin_corpus_dir

    if args.input or args.tokenizer or args.output_prefix:
        raise ConfigError("--builtin-corpus", "builds its own data; --input, --tokenizer and --output-prefix do not "
                          "apply", "drop them, or drop --builtin-corpus")
    root = args.builtin_corpus or builtin_corpus_dir()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        try:
            paths = build_corpus(root, vocab_size=BUILTIN_VOCAB)
        except OSError as e:
            raise ConfigError("--builtin-corpus", f"cannot build in {root}: {e.strerror or e}",
                              "give a writable directory") from None
    print(f"built-in corpus in {paths.root}: tokenizer {paths.tokenizer_dir}, dataset {paths.data_prefix}")
    if args.builtin_corpus:
        print(f"jobs find it with {Env.CORPUS}={paths.root} in their environment")
    return 0
