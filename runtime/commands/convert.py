"""``liveshard convert``: Hugging Face weights in, Hugging Face weights out.

    # import: a Hugging Face model as a megatron torch_dist checkpoint (any layout)
    liveshard convert --from hf:/models/Llama-3.1-8B --to /ckpt/llama-8b --parallel tp=2,pp=2
    # export: a liveshard or Megatron-LM checkpoint (any layout) as sharded safetensors
    liveshard convert --from /ckpt/job/step-1000 --to hf:/models/out --tokenizer /models/Llama-3.1-8B
    # the spec.model section of a job that trains these weights
    liveshard convert --from hf:/models/Llama-3.1-8B --print-model

A job can also start from Hugging Face weights with no conversion step:
``spec.training.initialWeights: {format: huggingface, path: DIR}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from liveshard.runtime.errors import ConfigError

HF = "hf:"


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from", dest="source", required=True, metavar="SRC",
                   help="hf:DIR (config.json + *.safetensors) or a liveshard / Megatron-LM checkpoint directory")
    p.add_argument("--to", dest="target", metavar="DST",
                   help="a new checkpoint directory (import) or hf:DIR (export)")
    p.add_argument("--parallel", default=None, metavar="CFG",
                   help="import: the layout to write, e.g. tp=2,pp=2 (default: pp over --procs processes)")
    p.add_argument("--procs", type=int, default=None, metavar="N",
                   help="local processes doing the conversion (default 1): an import runs one per rank of the "
                        "layout it writes (--procs N alone: pp=N), an export shares the files among them")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                   help="dtype of the weights written (default: the source's): the checkpoint's parameters "
                        "(import) or the safetensors (export)")
    p.add_argument("--model", default=None, metavar="PRESET|FILE|hf:CONFIG_DIR",
                   help="export: the checkpoint's model when its liveshard.json does not record it "
                        "(Megatron-LM checkpoints)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="export: copy this directory's tokenizer files next to the weights")
    p.add_argument("--max-shard-size", default="5GiB", metavar="SIZE",
                   help="export: the largest safetensors file (default 5GiB)")
    p.add_argument("--print-model", action="store_true",
                   help="print the spec.model section for the hf:DIR given to --from, and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    from liveshard.runtime import quiet

    # megatron-core's and torch's warnings (here and in the processes it spawns, through the
    # variable) are no news to a person converting weights: off the console (``quiet``)
    os.environ.setdefault(quiet.WARNINGS_ENV, os.devnull)
    quiet.warnings_to(os.environ[quiet.WARNINGS_ENV])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from liveshard.runtime.hf.checkpoint import config_dtype, read_config
    from liveshard.runtime.hf.config import spec_from_hf_config
    from liveshard.runtime.spec import CRD_NAMES

    if args.procs is not None and args.procs < 1:
        raise ConfigError("--procs", f"{args.procs} is not a positive number of processes")
    source_hf = args.source.startswith(HF)
    if args.print_model:
        if not source_hf:
            raise ConfigError("--print-model", "needs --from hf:DIR")
        import yaml

        directory = args.source[len(HF):]
        config = read_config(directory)
        spec = spec_from_hf_config(config, params_dtype=args.dtype or config_dtype(config),
                                   source=f"{directory}/config.json")
        unused = {"multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                  "v_head_dim", "moe_first_dense_layers",
                  "params_dtype"}  # a job's dtype is spec.training.precision
        fields = {CRD_NAMES[k]: v for k, v in spec.to_dict().items() if v is not None and k not in unused}
        print(yaml.safe_dump({"model": fields}, sort_keys=False), end="")
        return 0
    if not args.target:
        raise ConfigError("--to", "is required", "a new directory (import) or hf:DIR (export)")
    target_hf = args.target.startswith(HF)
    if source_hf == target_hf:
        raise ConfigError("--to", "one side must be hf:DIR and the other a checkpoint directory",
                          "import: --from hf:DIR --to DIR; export: --from DIR --to hf:DIR")
    if source_hf:
        return _import(args, args.source[len(HF):], args.target)
    return _export(args, args.source, args.target[len(HF):])


def _import(args: argparse.Namespace, source: str, target: str) -> int:
    from liveshard.runtime.hf.checkpoint import config_dtype, read_config
    from liveshard.runtime.hf.config import spec_from_hf_config
    from liveshard.runtime.hf.convert import run_import
    from liveshard.runtime.parallel import ParallelConfig
    from liveshard.runtime.spec import human_count

    if args.parallel:  # the flags first: they are checked without reading anything
        parallel = ParallelConfig.parse(args.parallel).with_even_dp()  # the import's layout; no batches
        if args.procs is not None and args.procs != parallel.world_size:
            raise ConfigError("--procs", f"{args.procs} differs from --parallel's world size {parallel.world_size}",
                              "leave --procs out: an import runs one process per rank")
    config = read_config(source)
    spec = spec_from_hf_config(config, params_dtype=args.dtype or config_dtype(config), source=f"{source}/config.json")
    if not args.parallel:
        n = args.procs or 1
        parallel = ParallelConfig.parse(f"tp=1,pp={n},dp=1" if n <= spec.num_layers else f"tp=1,pp=1,dp={n}")
    results = run_import(spec, parallel, source, target, show_progress=not args.no_progress and sys.stderr.isatty())
    read = sum(r.bytes_read for r in results)
    local = sum(r.local_bytes for r in results)
    print(f"imported {spec.name} ({human_count(spec.num_parameters())} parameters, {spec.params_dtype}) into "
          f"{target} as {parallel}: read {read / 2**20:.1f} MiB for {local / 2**20:.1f} MiB of local state, "
          f"load {max(r.load_seconds for r in results):.2f} s, save {max(r.save_seconds for r in results):.2f} s")
    return 0


def _export(args: argparse.Namespace, source: str, target: str) -> int:
    from liveshard.runtime.hf.convert import checkpoint_model, run_export
    from liveshard.runtime.spec import load_model
    from liveshard.runtime.units import parse_bytes

    max_shard_bytes = parse_bytes(args.max_shard_size, "--max-shard-size")  # the flags first

    spec = None
    if args.model:
        if args.model.startswith(HF):
            from liveshard.runtime.hf.checkpoint import config_dtype, read_config
            from liveshard.runtime.hf.config import spec_from_hf_config

            config = read_config(args.model[len(HF):])
            spec = spec_from_hf_config(config, params_dtype=config_dtype(config))
        else:
            spec = load_model(args.model)
    else:
        spec = checkpoint_model(source)
    if spec is None:
        raise ConfigError("--model", f"{source} does not record its model (no liveshard.json)",
                          "pass --model PRESET|FILE or --model hf:DIR (a config.json)")
    if args.parallel:
        raise ConfigError("--parallel", "is for import; an export reads any layout", "leave --parallel out")
    run_export(source, spec, target, procs=args.procs or 1, dtype=args.dtype,
               max_shard_bytes=max_shard_bytes, tokenizer=args.tokenizer)
    print(f"exported {spec.name} from {source} to {target}")
    return 0
