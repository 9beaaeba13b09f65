"""Inference dump: latent activations of every token as a scipy CSR matrix, plus reconstruction metrics.

`patch_acts.npz` (scipy.sparse.save_npz, uncompressed) holds a CSR matrix of shape
(n_samples * tokens_per_example, n_latents): row `sample * tokens_per_example + token`,
column = latent, values float32 in the SAE's normalised input space. Padding positions of
text samples (token >= length) are rows with no entries, so the row arithmetic is the same for
every sample.
"""

from __future__ import annotations

import datetime
import os
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import scipy.sparse as sp
import torch

from ..atomic import fsync_file, remove_orphaned_tmp, remove_tree, replace_dir, write_json_atomic
from ..errors import ConfigError, RunError
from ..reader import Reader
from .model import SparseAutoencoder, load_sae
from .train import resolve_device
from ..jsonio import peek_json

if TYPE_CHECKING:
    from ..runs import Run

INFERENCE_FORMAT = "actlake-inference/1"
CHUNK_TOKENS = 16_384


@dataclass
class InferenceResult:
    """The CSR latent matrix of one layer of one activation directory, and its metrics."""

    acts: sp.csr_matrix
    metrics: dict[str, Any]
    latent_counts: np.ndarray  # [n_latents] tokens each latent fired on


@torch.no_grad()
def encode_chunk(sae: SparseAutoencoder, x_nd: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray, torch.Tensor]:
    """Latents of normalised rows as CSR pieces: (nnz per row, columns, values, reconstruction).

    Columns are ascending within each row; exact zeros (ReLU'd top-k values) are dropped.
    """
    pre_nk = sae.pre_acts(x_nd)
    z_nk, vals, idx = sae.activate(pre_nk)
    if vals is not None and idx is not None:
        x_hat = sae._decode_sparse(vals, idx)
        order = idx.argsort(dim=1)
        idx = idx.gather(1, order)
        vals = vals.gather(1, order)
        keep = vals > 0
        counts = keep.sum(1)
        cols = idx[keep]
        data = vals[keep]
    else:
        x_hat = sae.decode(z_nk)
        keep = z_nk > 0
        counts = keep.sum(1)
        nz = keep.nonzero(as_tuple=False)  # row-major, ascending columns
        cols = nz[:, 1]
        data = z_nk[keep]
    return (counts.cpu().numpy().astype(np.int64), cols.cpu().numpy().astype(np.int32),
            data.float().cpu().numpy(), x_hat)


def infer_reader(sae: SparseAutoencoder, reader: Reader, layer: int, *, device: str | torch.device = "cpu",
                 progress: bool = True, chunk_tokens: int = CHUNK_TOKENS) -> InferenceResult:
    """Encode every real token of `layer`; build the CSR dump and the reconstruction metrics."""
    from tqdm.auto import tqdm

    reader.layer_index(layer)
    cfg = sae.config
    if reader.d_model != cfg.d_model:
        raise ConfigError(f"store d_model {reader.d_model} does not match the SAE's {cfg.d_model}", reader.path)
    dev = torch.device(device)
    sae = sae.to(dev).eval()
    scale = float(sae.input_scale)
    n, t = reader.n_samples, reader.max_tokens
    lengths = reader.lengths.astype(np.int64)
    per_chunk = max(1, chunk_tokens // max(t, 1))
    counts_parts: list[np.ndarray] = []
    cols_parts: list[np.ndarray] = []
    data_parts: list[np.ndarray] = []
    latent_counts = np.zeros(cfg.n_latents, dtype=np.int64)
    sse = 0.0
    sum_sq = 0.0
    sum_x = np.zeros(cfg.d_model, dtype=np.float64)
    n_real = 0
    bar = tqdm(total=int(lengths.sum()), unit="tok", unit_scale=True, desc="infer", file=sys.stderr,
               disable=not progress, dynamic_ncols=True)
    try:
        for start in range(0, n, per_chunk):
            stop = min(n, start + per_chunk)
            batch = reader.batch(np.arange(start, stop), [layer])
            acts_btd = batch.acts_bltd[:, 0]
            lens = lengths[start:stop]
            mask_bt = np.arange(t)[None, :] < lens[:, None]
            x_nd = torch.from_numpy(np.ascontiguousarray(acts_btd[mask_bt], dtype=np.float32)).to(dev) * scale
            row_counts = np.zeros(mask_bt.shape, dtype=np.int64)
            if len(x_nd):
                counts, cols, data, x_hat = encode_chunk(sae, x_nd)
                row_counts[mask_bt] = counts
                cols_parts.append(cols)
                data_parts.append(data)
                latent_counts += np.bincount(cols, minlength=cfg.n_latents)
                x64 = x_nd.double()
                sse += float((x64 - x_hat.double()).pow(2).sum())
                sum_sq += float(x64.pow(2).sum())
                sum_x += x64.sum(0).cpu().numpy()
                n_real += len(x_nd)
            counts_parts.append(row_counts.reshape(-1))
            bar.update(int(lens.sum()))
    finally:
        bar.close()
    row_nnz = np.concatenate(counts_parts) if counts_parts else np.zeros(0, np.int64)
    indptr = np.zeros(n * t + 1, dtype=np.int64)
    np.cumsum(row_nnz, out=indptr[1:])
    nnz = int(indptr[-1])
    if nnz < np.iinfo(np.int32).max:
        indptr = indptr.astype(np.int32)
    indices = np.concatenate(cols_parts) if cols_parts else np.zeros(0, np.int32)
    data = np.concatenate(data_parts) if data_parts else np.zeros(0, np.float32)
    mat = sp.csr_matrix((data, indices, indptr), shape=(n * t, cfg.n_latents))
    total_var = sum_sq - float(sum_x @ sum_x) / max(n_real, 1)
    metrics = {
        "n_samples": int(n),
        "tokens_per_example": int(t),
        "n_rows": int(n * t),
        "n_tokens": int(n_real),
        "n_latents": int(cfg.n_latents),
        "nnz": nnz,
        "nmse": sse / sum_sq if sum_sq > 0 else float("nan"),
        "mse": sse / max(n_real * cfg.d_model, 1),
        "explained_variance": 1.0 - sse / total_var if total_var > 0 else float("nan"),
        "l0": nnz / max(n_real, 1),
        "dead_frac": float((latent_counts == 0).mean()),
        "dense_frac": float((latent_counts > 0.1 * max(n_real, 1)).mean()),
        "input_scale": scale,
    }
    return InferenceResult(acts=mat, metrics=metrics, latent_counts=latent_counts)


def infer_run(run: "Run", shards: str | Path | None = None, *, device: str = "auto", overwrite: bool = False,
              progress: bool = True) -> Path:
    """Write `inference/<shard_hash>/{config.json, patch_acts.npz, metrics.json}` for the run's SAE.

    Default shards: links/val-shards if present, else links/train-shards. A dump made from the
    same checkpoint already there is kept (returned as is); one from another checkpoint is a
    RunError unless `overwrite`.
    """
    from ..run_guard import check_links, run_lock

    cfg = run.read_config()
    if not run.has_checkpoint:
        raise RunError("run has no checkpoint/sae.pt (train it first)", run.sae_path)
    check_links(run, cfg)
    with run_lock(run, "inference"):
        remove_orphaned_tmp(run.inference_root)
        return _infer_locked(run, cfg, shards, device=device, overwrite=overwrite, progress=progress)


def _dump_is_whole(out: Path, recorded: dict[str, Any]) -> bool:
    """Whether an existing dump's patch_acts.npz is the one its config.json recorded (sha256), so a
    truncated or replaced dump is never handed back as done."""
    from ..hashing import file_sha256

    want = recorded.get("patch_acts_sha256")
    return isinstance(want, str) and (out / "patch_acts.npz").is_file() and file_sha256(out / "patch_acts.npz") == want


def _infer_locked(run: "Run", cfg: dict[str, Any], shards: str | Path | None, *, device: str, overwrite: bool,
                  progress: bool) -> Path:
    import actlake
    from ..runs import file_sha256, shard_hash_of

    if shards is None:
        shards_path = run.val_shards or run.train_shards
    else:
        shards_path = Path(shards)
        if not shards_path.is_dir():
            raise RunError("shards directory does not exist", shards_path)
    shard_hash = shard_hash_of(shards_path)
    out = run.inference_dir(shard_hash)
    ckpt_sha = file_sha256(run.sae_path)
    if (out / "patch_acts.npz").is_file() and (out / "config.json").is_file() and not overwrite:
        old = peek_json(out / "config.json")
        old = old if isinstance(old, dict) else {}
        if old.get("checkpoint_sha256") == ckpt_sha and _dump_is_whole(out, old):
            return out
        if old.get("checkpoint_sha256") not in (None, ckpt_sha):
            raise RunError("an inference dump from another checkpoint exists (use --overwrite)", out)
        # a dump of this checkpoint that is damaged (or has no record of its bytes): written again below
    dev = resolve_device(device)
    sae, blob = load_sae(run.sae_path, device=dev)
    layer = int(cfg["layer"])
    with actlake.open(shards_path) as reader:
        result = infer_reader(sae, reader, layer, device=dev, progress=progress)
        has_texts = reader.texts is not None
    run.inference_root.mkdir(parents=True, exist_ok=True)
    tmp = run.inference_root / f".tmp-{shard_hash}-{os.getpid()}"
    remove_tree(tmp)
    tmp.mkdir(parents=True)
    sp.save_npz(tmp / "patch_acts.npz", result.acts, compressed=False)
    fsync_file(tmp / "patch_acts.npz")
    metrics = {**result.metrics, "layer": layer, "shard_hash": shard_hash}
    write_json_atomic(tmp / "metrics.json", metrics)
    write_json_atomic(tmp / "config.json", {
        "format": INFERENCE_FORMAT,
        "run_id": run.run_id,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shards": str(Path(shards_path).resolve()),
        "shard_hash": shard_hash,
        "layer": layer,
        "n_samples": metrics["n_samples"],
        "tokens_per_example": metrics["tokens_per_example"],
        "n_latents": metrics["n_latents"],
        "rows": "sample * tokens_per_example + token",
        "padding": "zero rows",
        "values": "latent activations of inputs scaled by input_scale",
        "input_scale": metrics["input_scale"],
        "has_texts": has_texts,
        "checkpoint": "checkpoint/sae.pt",
        "checkpoint_sha256": ckpt_sha,
        "patch_acts_sha256": file_sha256(tmp / "patch_acts.npz"),
        "sae": sae.config.to_json(),
    })
    return replace_dir(tmp, out)


def load_patch_acts(inference_dir: Path) -> sp.csr_matrix:
    """patch_acts.npz of an inference directory as CSR (a typed error when it is not one)."""
    from ..errors import FormatError, MissingFileError

    f = Path(inference_dir) / "patch_acts.npz"
    if not f.is_file():
        raise MissingFileError("inference dump is missing (run `actlake infer --run` first)", f)
    try:
        return sp.load_npz(f).tocsr()
    except (ValueError, OSError, KeyError, EOFError, zipfile.BadZipFile) as exc:  # a truncated zip among them
        raise FormatError(f"not a whole scipy sparse npz ({type(exc).__name__}: {str(exc)[:200]})", f) from exc
