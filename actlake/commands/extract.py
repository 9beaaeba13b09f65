"""`actlake extract`: activations of a model over a dataset into any registered format (resumable)."""

from __future__ import annotations

import argparse

from ..options import parse_options

NAME = "extract"
HELP = "extract activations of a model over a dataset into a store (resumes an interrupted run)"


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments shared by `extract` and `demo`."""
    p.add_argument("--max-seq-len", type=int, default=128, help="truncate texts to this many tokens (default 128)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per forward pass (default 32)")
    p.add_argument("--device", default="auto", help="auto|cpu|cuda (default auto: cuda when available)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local HF model dir, 'minilm', or 'tiny-random:<arch>'")
    p.add_argument("--data", required=True,
                   help="dataset: .txt/.jsonl/.parquet file, load_from_disk dir, image folder, or builtin:stdlib-docs")
    p.add_argument("--layers", default="all", help="'all' or comma-separated block indices, e.g. 0,3,-1 (default all)")
    p.add_argument("--format", default="saev", help="store format (any registered name; default saev)")
    p.add_argument("--out", default=None, help="output root, a local path or an fsspec URL (s3://, gs://, memory://; docs/remote.md) (default: the shards root, $SAEV_SCRATCH/saev/shards, else ./actlake-data/saev/shards)")
    add_common_arguments(p)
    p.add_argument("--dtype", default=None, help="storage dtype float32|float16 (default: the format's)")
    p.add_argument("--model-dtype", default="float32", help="compute dtype float32|float16|bfloat16")
    p.add_argument("--machine-id", type=int, default=0, help="this machine's index (default 0)")
    p.add_argument("--num-machines", type=int, default=1, help="number of machines sharing the dataset (default 1)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N samples of the dataset")
    p.add_argument("--padding-side", default="right", choices=("right", "left"), help="padding side (default right)")
    p.add_argument("--option", action="append", metavar="KEY=VALUE",
                   help="format/engine knob, repeatable (e.g. patches_per_shard=100000, logits_topk=5)")
    p.add_argument("--text-field", default="text", help="JSONL/Parquet/HF field holding the text (default text)")
    p.add_argument("--prompt-field", default=None, help="field holding the prompt (prompt/response datasets)")
    p.add_argument("--response-field", default=None, help="field holding the response (prompt/response datasets)")
    p.add_argument("--label-field", default=None, help="field holding a class label (default: 'label' if present)")
    p.add_argument("--id-field", default=None, help="field holding a sample id (default: 'id' if present)")
    p.add_argument("--split", default="all", choices=("all", "train", "val"),
                   help="which samples: all (default), or the train / val side of --val-fraction (held out by a "
                        "hash of each sample's id; never the same samples, independent of --num-machines)")
    p.add_argument("--val-fraction", type=float, default=0.0, metavar="F",
                   help="fraction of samples held out as the val split (0 < F < 1 with --split train|val)")
    p.add_argument("--dataset-split", default=None, help="named split of a load_from_disk DatasetDict (default train)")
    p.add_argument("--masks", default=None, help="segmentation mask folder mirroring an image folder")
    p.add_argument("--generate-max-new-tokens", type=int, default=None, metavar="N",
                   help="causal LMs: greedily generate N-token responses to the prompts first, then store prompt and "
                        "response activations apart (the generated text is stored)")


def run(args: argparse.Namespace) -> int:
    from ..extract import DatasetFields, ExtractConfig, extract
    from ..runs import shards_root

    fields = DatasetFields(text=args.text_field, prompt=args.prompt_field, response=args.response_field,
                           label=args.label_field, id=args.id_field, split=args.dataset_split, masks=args.masks)
    from ..remote.url import is_url, local_path

    remote = args.out if is_url(args.out) else None
    if remote is not None and args.num_machines != 1:
        from ..errors import ConfigError

        raise ConfigError("--out URL takes a whole store: extract the machine slices locally, merge them, and "
                          "upload the merged store (docs/remote.md)")
    if remote is not None:
        from ..remote.publish import staging_dir

        args.out = str(staging_dir(remote))
    cfg = ExtractConfig(
        model=args.model, data=args.data, out=local_path(args.out) if args.out else shards_root(), layers=args.layers, format=args.format,
        max_seq_len=args.max_seq_len, batch_size=args.batch_size, dtype=args.dtype, model_dtype=args.model_dtype,
        machine_id=args.machine_id, num_machines=args.num_machines, device=args.device, limit=args.limit,
        options=parse_options(args.option), fields=fields, padding_side=args.padding_side,
        progress=not args.no_progress, generate_max_new_tokens=args.generate_max_new_tokens,
        split=args.split, val_fraction=args.val_fraction,
    )
    result = extract(cfg)
    if result.n_samples and result.resumed_from >= result.n_samples:
        print(f"already extracted: {result.n_samples} samples x {len(result.spec.layers)} layers")
    else:
        note = f" (resumed after {result.resumed_from} samples)" if result.resumed_from else ""
        print(f"extracted {result.n_samples} samples x {len(result.spec.layers)} layers in {result.seconds:.1f}s{note}")
    if result.run_dir != result.path:
        state = "complete (manifest written)" if result.complete else "waiting for the other machines' slices"
        print(f"run directory {result.run_dir}: {state}")
    if remote is not None:
        from ..remote.publish import publish_to

        print(publish_to(remote, lambda _stage: result.path))
        return 0
    print(result.path)
    return 0
