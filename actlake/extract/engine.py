"""The extraction engine: one forward pass per batch, hooks on the requested blocks, a background writer.

Flow: load model + dataset -> this machine's slice -> tokenise (lengths fix the store's token
axis) -> StoreSpec -> `create_writer(format, out, spec)` -> skip `writer.resume_from` samples ->
for each length-bucketed batch, forward under `torch.inference_mode()` until the deepest
requested block, hand the captured tensors to a writer thread (bounded queue) that copies them
to host, puts samples back in dataset order and calls `writer.write_batch` -> `writer.close()`.
"""

from __future__ import annotations

import json
import os
import platform
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ..batch import Batch
from ..devices import check_device, resolve_device
from ..errors import ConfigError, DatasetError, FormatError
from ..spec import StoreSpec
from .batching import (
    PADDING_SIDES,
    Tokenized,
    Window,
    machine_slice,
    pad_batch,
    plan_windows,
    token_lengths,
    tokenize_pairs,
    tokenize_texts,
)
from .datasets import (
    Dataset,
    DatasetFields,
    check_split,
    load_pixels,
    materialize_dataset,
    open_dataset,
    patch_labels,
    select_split,
)
from .generate import generate_responses
from .layers import LayerCapture, find_blocks, normalize_layers
from .models import LoadedModel, load_model, set_offline

STORAGE_DTYPES = ("float32", "float16")
LAYER_NUMBERING = "layer l = output of block l = hidden_states[l + 1]; negative indices count from the end"


@dataclass(frozen=True)
class ExtractConfig:
    """Everything one extraction run needs; validated on construction.

    split / val_fraction: which samples ('all', or the 'train' / 'val' side of a held-out fraction
    chosen by a hash of each sample's key; docs/formats/extraction.md). machine_id / num_machines:
    this machine's slice of the selected split (machine facts never enter the stores' identity).
    datasets_root: where a dataset with no file on disk (builtin) is materialised for run links
    (None: `<shards_root().parent>/datasets`).

    dtype: storage dtype (None: the format's DEFAULT_DTYPE, else float32); model_dtype: compute dtype.
    options: per-format knobs passed to the writer (`StoreSpec.options`); the engine itself reads
    `logits_topk` (int k: top-k logits + token perplexity, causal LMs) and `response_max_tokens`.
    bucket_batches: batches per length-sorting window. queue_depth: batches in flight to the writer.
    """

    model: str
    data: str
    out: str | Path
    layers: Sequence[int] | str = "all"
    format: str = "saev"
    max_seq_len: int = 128
    batch_size: int = 32
    dtype: str | None = None
    model_dtype: str = "float32"
    machine_id: int = 0
    num_machines: int = 1
    device: str = "auto"
    limit: int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    fields: DatasetFields = field(default_factory=DatasetFields)
    padding_side: str = "right"
    bucket_batches: int = 4
    queue_depth: int = 2
    progress: bool = False
    generate_max_new_tokens: int | None = None
    split: str = "all"
    val_fraction: float = 0.0
    datasets_root: str | Path | None = None

    def __post_init__(self) -> None:
        if self.max_seq_len < 2:
            raise ConfigError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.dtype is not None and self.dtype not in STORAGE_DTYPES:
            raise ConfigError(f"storage dtype must be one of {STORAGE_DTYPES}, got {self.dtype!r}")
        check_device(self.device)
        if self.padding_side not in PADDING_SIDES:
            raise ConfigError(f"padding_side must be one of {PADDING_SIDES}, got {self.padding_side!r}")
        check_split(self.split, self.val_fraction)
        if not 0 <= self.machine_id < self.num_machines:
            raise ConfigError(f"machine_id {self.machine_id} not in [0, {self.num_machines})")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"limit must be >= 1, got {self.limit}")
        if self.queue_depth < 1 or self.bucket_batches < 1:
            raise ConfigError("queue_depth and bucket_batches must be >= 1")
        if self.generate_max_new_tokens is not None and self.generate_max_new_tokens < 1:
            raise ConfigError(f"generate_max_new_tokens must be >= 1, got {self.generate_max_new_tokens}")
        k = self.options.get("logits_topk")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ConfigError(f"option logits_topk must be a positive integer, got {k!r}")


@dataclass(frozen=True)
class ExtractResult:
    """What a run did: where the store is, and how much work this invocation did.

    path: this machine's published store (the store itself when num_machines == 1); run_dir: the
    directory holding every machine's slice (== path when num_machines == 1); complete: every
    slice is published and the run's manifest is written.
    """

    path: Path
    spec: StoreSpec
    n_samples: int
    resumed_from: int
    n_tokens: int
    seconds: float
    batches: int
    run_dir: Path | None = None
    complete: bool = True

    def __post_init__(self) -> None:
        if self.run_dir is None:
            object.__setattr__(self, "run_dir", self.path)


def created_at() -> str:
    """UTC ISO timestamp; `SOURCE_DATE_EPOCH` (reproducible builds) pins it for byte-identical reruns."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    moment = datetime.fromtimestamp(int(epoch), timezone.utc) if epoch else datetime.now(timezone.utc)
    return moment.replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _default_dtype(format_name: str) -> str:
    from ..formats import format_module

    return str(getattr(format_module(format_name), "DEFAULT_DTYPE", "float32"))


# ------------------------------------------------------------------------------------------
# the plan of one run
# ------------------------------------------------------------------------------------------


@dataclass
class _Plan:
    """This machine's slice, its token data, and the fixed shapes of the store."""

    start: int
    stop: int
    samples_per_machine: int
    lengths: np.ndarray  # [n] total real tokens (prompt + response)
    prompt_lengths: np.ndarray  # [n] tokens stored in acts_bltd
    tokens: Tokenized | None
    max_tokens: int
    response_tokens: int  # 0 without a response part

    @property
    def n(self) -> int:
        return self.stop - self.start


def _make_plan(loaded: LoadedModel, ds: Dataset, cfg: ExtractConfig) -> _Plan:
    """This machine's slice and tokens; the fixed shapes (T, R) come from the WHOLE dataset, so every
    machine of a run computes the same ones and their slices merge."""
    start, stop, spm = machine_slice(len(ds), cfg.machine_id, cfg.num_machines)
    n = stop - start
    whole = n == len(ds)
    if loaded.geometry is not None:
        t = loaded.geometry.n_patches + (1 if loaded.cls_token else 0)
        lengths = np.full(n, t, dtype=np.int64)
        return _Plan(start, stop, spm, lengths, lengths, None, t, 0)
    assert ds.texts is not None
    texts = ds.texts[start:stop]
    if ds.kind == "prompt_response":
        assert ds.responses is not None
        r_max = cfg.options.get("response_max_tokens")
        if r_max is None and cfg.generate_max_new_tokens is not None:
            r_max = cfg.generate_max_new_tokens  # other machines' generations are unknown here: cap at the budget
        cap = None if r_max is None else int(r_max)
        tok = tokenize_pairs(loaded.tokenizer, texts, ds.responses[start:stop], cfg.max_seq_len, cap)
        full = tok if whole else tokenize_pairs(loaded.tokenizer, ds.texts, ds.responses, cfg.max_seq_len, cap)
        response = full.lengths - full.prompt_lengths
        p_t = int(full.prompt_lengths.max()) if len(full) else 1
        r_t = cap if cap is not None else (int(response.max()) if len(full) else 1)
        return _Plan(start, stop, spm, tok.lengths, tok.prompt_lengths, tok, max(p_t, 1), max(r_t, 1))
    tok = tokenize_texts(loaded.tokenizer, texts, cfg.max_seq_len)
    all_lengths = tok.lengths if whole else token_lengths(loaded.tokenizer, ds.texts, cfg.max_seq_len)
    t = int(all_lengths.max()) if len(all_lengths) else 1
    return _Plan(start, stop, spm, tok.lengths, tok.lengths, tok, t, 0)


def _versions() -> dict[str, str]:
    import torch
    import transformers

    from .. import __version__

    return {"python_version": platform.python_version(), "torch_version": torch.__version__,
            "transformers_version": transformers.__version__, "numpy_version": np.__version__,
            "actlake_version": __version__}


def build_spec(loaded: LoadedModel, ds: Dataset, cfg: ExtractConfig, layers: tuple[int, ...], plan: _Plan,
               dtype: str, device: str) -> StoreSpec:
    """The StoreSpec: hashed identity in `data`, build facts in `provenance`."""
    vision = loaded.geometry is not None
    data: dict[str, Any] = {
        "model": loaded.name,
        "weights_sha256": loaded.weights_sha256,
        "model_dtype": loaded.dtype,
        "dataset": ds.describe(),
        "layers": list(layers),
    }
    if vision:
        assert loaded.geometry is not None
        data["image"] = loaded.geometry.describe()
        data["token_layout"] = "cls+patches" if loaded.cls_token else "patches"
    else:
        data["max_seq_length"] = cfg.max_seq_len
        data["token_layout"] = "real tokens first, then zero padding"
    if plan.response_tokens:
        data["response_max_tokens"] = plan.response_tokens
    # as plain JSON data: the merge of a run's slices rebuilds this spec from JSON, and saev hashes a
    # pickle of `data` whose bytes depend on which equal strings are one object
    data = json.loads(json.dumps(data))
    n_truncated = int(plan.tokens.truncated.sum()) if plan.tokens is not None else 0
    provenance: dict[str, Any] = {
        "model_name": loaded.name,
        "model_class": type(loaded.model).__name__,
        "model_type": loaded.model_type,
        "family": loaded.family,
        "model_params": loaded.params,
        "checkpoint_path": str(loaded.source.path) if loaded.source.path is not None else None,
        "weights_sha256": loaded.weights_sha256,
        "weight_files": dict(loaded.weight_files),
        "model_dtype": loaded.dtype,
        "dataset_spec": ds.spec,
        "dataset_root": ds.root,
        "dataset_kind": ds.kind,
        "dataset_format": ds.source_format,
        "dataset_fingerprint": ds.fingerprint,
        "dataset_n_samples": len(ds),
        "dataset": ds.describe(),
        "layers": list(layers),
        "layer_numbering": LAYER_NUMBERING,
        "block_path": find_blocks(loaded.model)[0],
        "n_blocks": loaded.n_blocks,
        "max_seq_length": cfg.max_seq_len,
        "max_tokens": plan.max_tokens,
        "n_truncated": n_truncated,
        "dtype": dtype,
        "batch_size": cfg.batch_size,
        "bucket_batches": cfg.bucket_batches,
        "padding_side": cfg.padding_side,
        "device": device,
        "machine_id": cfg.machine_id,
        "num_machines": cfg.num_machines,
        "samples_per_machine": plan.samples_per_machine,
        "sample_range": [plan.start, plan.stop],
        "created_at": created_at(),
        **_versions(),
    }
    if plan.response_tokens:
        provenance["response_max_tokens"] = plan.response_tokens
    if cfg.split != "all":
        provenance["split"] = {"split": cfg.split, "val_fraction": cfg.val_fraction}
    spec = StoreSpec(
        layers=layers, d_model=loaded.d_model, max_tokens=plan.max_tokens, n_samples=plan.n,
        model_name=loaded.name, family=loaded.family, cls_token=loaded.cls_token, dataset=ds.root, data=data,
        provenance=provenance, dtype=dtype, machine_id=cfg.machine_id, num_machines=cfg.num_machines,
        has_token_labels=vision and ds.has_masks, options=dict(cfg.options),
    )
    provenance["run"] = run_block(spec, len(ds))
    return spec


def run_block(spec: StoreSpec, n_total: int) -> dict[str, Any]:
    """What `actlake.slices` needs to find and merge the slices of a run: the whole run's StoreSpec
    (identity fields; the one a 1-machine run of the same config has), this slice's place and hash."""
    import dataclasses

    whole = dataclasses.replace(spec, machine_id=0, num_machines=1, n_samples=n_total, provenance={})
    fields = dataclasses.asdict(whole)
    fields.pop("provenance")
    return {"num_machines": spec.num_machines, "machine_id": spec.machine_id, "run_hash": spec.run_hash(),
            "slice_hash": spec.content_hash(), "store_hash": whole.content_hash(), "store_spec": fields}


# ------------------------------------------------------------------------------------------
# what the model thread hands the writer thread
# ------------------------------------------------------------------------------------------


@dataclass
class _Piece:
    """One computed batch: positions (slice-local), captured layers, and per-row extras."""

    window: int
    positions: np.ndarray
    starts: np.ndarray
    layers_host: Callable[[], list[np.ndarray]]  # [L] arrays [B, Tb, D], host memory
    token_labels: np.ndarray | None = None
    topk_values: np.ndarray | None = None
    topk_indices: np.ndarray | None = None
    logprobs: np.ndarray | None = None  # [B, Tb - 1] log p(token t+1 | ..t)


def _cpu_layers(outputs: list[Any]) -> Callable[[], list[np.ndarray]]:
    def get() -> list[np.ndarray]:
        import torch

        return [(o if o.dtype in (torch.float32, torch.float16) else o.float()).numpy() for o in outputs]

    return get


def _cuda_layers(outputs: list[Any], storage: Any) -> Callable[[], list[np.ndarray]]:
    """Stack on the GPU, start a non-blocking copy into pinned memory; the getter waits for it."""
    import torch

    stacked = torch.stack([o.to(storage) for o in outputs], dim=0)
    host = torch.empty(stacked.shape, dtype=storage, pin_memory=True)
    host.copy_(stacked, non_blocking=True)
    event = torch.cuda.Event()
    event.record()

    def get() -> list[np.ndarray]:
        event.synchronize()
        arr = host.numpy()
        return [arr[i] for i in range(arr.shape[0])]

    return get


class _Window:
    """Staging arrays of one window in dataset order, filled piece by piece as batches arrive."""

    def __init__(self, window: Window, plan: _Plan, spec: StoreSpec, np_dtype: np.dtype, k: int) -> None:
        n_w, n_layers, t, d = window.stop - window.start, len(spec.layers), spec.max_tokens, spec.d_model
        self.window, self.arrived = window, 0
        self.acts = np.zeros((n_w, n_layers, t, d), dtype=np_dtype)
        self.resp = np.zeros((n_w, n_layers, plan.response_tokens, d), dtype=np_dtype) if plan.response_tokens else None
        self.token_labels = np.zeros((n_w, t), dtype=np.uint8) if spec.has_token_labels else None
        self.top_v = np.zeros((n_w, k), dtype=np.float32) if k else None
        self.top_i = np.zeros((n_w, k), dtype=np.int64) if k else None
        self.ppl: list[list[float]] = [[] for _ in range(n_w)] if k else []


class _WriterThread(threading.Thread):
    """Copies each computed batch into its window's staging arrays (overlapping the next forward) and,
    once a window is complete, feeds `writer.write_batch` in dataset order; bounded queue in front."""

    def __init__(self, writer: Any, ds: Dataset, plan: _Plan, windows: list[Window], spec: StoreSpec,
                 skip_below: int, chunk: int, depth: int, out: Path, format_name: str) -> None:
        super().__init__(name="actlake-writer", daemon=True)
        self.writer, self.ds, self.plan, self.windows, self.spec, self.out = writer, ds, plan, windows, spec, out
        self.skip_below, self.chunk, self.format_name = skip_below, chunk, format_name
        self.queue: queue.Queue[_Piece | None] = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self._stop_now = threading.Event()
        self._staged: _Window | None = None
        self._np_dtype = np.dtype(spec.dtype)
        self._k = int(spec.options.get("logits_topk") or 0)

    def put(self, piece: _Piece | None) -> None:
        """Hand over a piece (None = end); raise the thread's error instead of blocking forever."""
        while True:
            self.raise_error()
            try:
                self.queue.put(piece, timeout=0.1)
                return
            except queue.Full:
                if not self.is_alive():
                    raise RuntimeError("the writer thread stopped without an error") from None

    def raise_error(self) -> None:
        """Re-raise the thread's error in the caller; an OSError (disk full, permissions) becomes a FormatError."""
        exc = self.error
        if exc is None:
            return
        if isinstance(exc, OSError):
            raise FormatError(f"writing the {self.format_name} store failed: {exc}", self.out) from exc
        raise exc

    def stop(self) -> None:
        self._stop_now.set()

    def run(self) -> None:
        try:
            while not self._stop_now.is_set():
                try:
                    piece = self.queue.get(timeout=0.1)
                except queue.Empty:
                    continue
                if piece is None:
                    return
                self._stage(piece)
        except BaseException as exc:  # noqa: BLE001 - handed to the model thread
            self.error = exc

    def _stage(self, piece: _Piece) -> None:
        """Copy the real tokens (and per-row extras) of one batch into its window; flush a complete window."""
        window = self.windows[piece.window]
        staged = self._staged
        if staged is None or staged.window is not window:
            staged = self._staged = _Window(window, self.plan, self.spec, self._np_dtype, self._k)
        hosts = piece.layers_host()
        w0, plan = window.start, self.plan
        for r, pos in enumerate(piece.positions.tolist()):
            if pos < self.skip_below:
                continue  # already durable from an interrupted run
            j, s = pos - w0, int(piece.starts[r])
            p = int(plan.prompt_lengths[pos])
            q = int(plan.lengths[pos]) - p
            for li, arr in enumerate(hosts):
                staged.acts[j, li, :p] = arr[r, s : s + p]
                if staged.resp is not None and q:
                    staged.resp[j, li, :q] = arr[r, s + p : s + p + q]
            if staged.token_labels is not None and piece.token_labels is not None:
                staged.token_labels[j] = piece.token_labels[r]
            if self._k:
                assert piece.topk_values is not None and piece.topk_indices is not None and piece.logprobs is not None
                staged.top_v[j], staged.top_i[j] = piece.topk_values[r], piece.topk_indices[r]  # type: ignore[index]
                staged.ppl[j] = np.exp(-piece.logprobs[r, s : s + p + q - 1].astype(np.float64)).tolist()
        staged.arrived += 1
        if staged.arrived == len(window.batches):
            self._staged = None
            self._flush(staged)

    def _flush(self, staged: _Window) -> None:
        window = staged.window
        for c in range(max(window.start, self.skip_below), window.stop, self.chunk):
            if self._stop_now.is_set():
                return
            self.writer.write_batch(self._batch(staged, c, min(c + self.chunk, window.stop)))

    def _batch(self, staged: _Window, start: int, stop: int) -> Batch:
        """Positions [start, stop) of a complete window as a Batch (arrays are views of the staging arrays)."""
        plan, ds = self.plan, self.ds
        a, b = start - staged.window.start, stop - staged.window.start
        positions = np.arange(start, stop)
        p_len = plan.prompt_lengths[start:stop]
        g = plan.start + positions  # = machine_id * samples_per_machine + local_idx
        token_ids = texts = responses = None
        extra: dict[str, Any] = {}
        if plan.tokens is not None:
            token_ids = np.zeros((stop - start, self.spec.max_tokens), dtype=np.int64)
            for j, pos in enumerate(range(start, stop)):
                token_ids[j, : p_len[j]] = plan.tokens.ids(pos)[: p_len[j]]
            assert ds.texts is not None
            texts = list(ds.texts[plan.start + start : plan.start + stop])
            if ds.responses is not None:
                responses = list(ds.responses[plan.start + start : plan.start + stop])
            extra["truncated"] = plan.tokens.truncated[start:stop].tolist()
        if ds.ids is not None:
            extra["id"] = [str(x) for x in ds.ids[plan.start + start : plan.start + stop]]
        if self._k:
            extra["token_perplexity"] = staged.ppl[a:b]
        resp = None if staged.resp is None else staged.resp[a:b]
        extra = dict(sorted(extra.items()))  # the order readers give them back in (a merge writes the same bytes)
        return Batch(
            acts_bltd=staged.acts[a:b], lengths=p_len.astype(np.int64), sample_ids=g.astype(np.int64), texts=texts,
            labels=None if ds.labels is None else ds.labels[g],
            token_labels=None if staged.token_labels is None else staged.token_labels[a:b], token_ids=token_ids,
            response_bltd=resp, response_lengths=None if resp is None else (plan.lengths[start:stop] - p_len).astype(np.int64),
            response_texts=responses, logits_topk_values=None if staged.top_v is None else staged.top_v[a:b],
            logits_topk_indices=None if staged.top_i is None else staged.top_i[a:b], extra=extra,
        )


# ------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------


def _check_match(loaded: LoadedModel, ds: Dataset) -> None:
    if loaded.geometry is not None and ds.kind != "image":
        raise DatasetError(f"model {loaded.name} is a vision model but the dataset holds {ds.kind}", ds.root)
    if loaded.geometry is None and ds.kind == "image":
        raise DatasetError(f"model {loaded.name} is a text model but the dataset holds images", ds.root)


def extract(cfg: ExtractConfig, *, model: LoadedModel | None = None, dataset: Dataset | None = None) -> ExtractResult:
    """Run one extraction (resuming an interrupted one with the same arguments); return the published path."""
    set_offline()
    import torch

    from ..formats import create_writer

    t0 = time.perf_counter()
    device = resolve_device(cfg.device) if model is None else model.device
    loaded = model or load_model(cfg.model, device=device, dtype=cfg.model_dtype)
    ds = select_split(dataset or open_dataset(cfg.data, cfg.fields, limit=cfg.limit), cfg.split, cfg.val_fraction)
    _check_match(loaded, ds)
    dataset_root = _dataset_root(ds, cfg)
    if cfg.generate_max_new_tokens is not None:
        start, stop, _ = machine_slice(len(ds), cfg.machine_id, cfg.num_machines)
        ds = generate_responses(loaded, ds, max_new_tokens=cfg.generate_max_new_tokens, start=start, stop=stop,
                                batch_size=cfg.batch_size, max_seq_len=cfg.max_seq_len, progress=cfg.progress)
    k = cfg.options.get("logits_topk")
    if k is not None and not loaded.causal_lm:
        raise ConfigError(f"option logits_topk needs a causal language model; {loaded.name} is {loaded.model_type}")
    if k is not None and k > int(loaded.params.get("vocab_size") or k):
        raise ConfigError(f"option logits_topk={k} exceeds the vocabulary ({loaded.params['vocab_size']})")
    layers = normalize_layers(cfg.layers, loaded.n_blocks)
    dtype = cfg.dtype or _default_dtype(cfg.format)
    if dtype not in STORAGE_DTYPES:
        raise ConfigError(f"storage dtype must be one of {STORAGE_DTYPES}, got {dtype!r}")
    plan = _make_plan(loaded, ds, cfg)
    spec = build_spec(loaded, ds, cfg, layers, plan, dtype, device)
    if dataset_root is not None:
        spec.provenance["dataset_root"] = str(dataset_root)
    try:
        writer = create_writer(cfg.format, Path(cfg.out), spec)
    except OSError as exc:
        raise FormatError(f"cannot create the {cfg.format} store: {exc}", Path(cfg.out)) from exc
    resumed = min(int(writer.resume_from), plan.n)
    windows = plan_windows(plan.lengths, cfg.batch_size, cfg.bucket_batches)
    todo = [(i, w) for i, w in enumerate(windows) if w.stop > resumed]
    thread = _WriterThread(writer, ds, plan, windows, spec, resumed, cfg.batch_size, cfg.queue_depth, Path(cfg.out),
                           cfg.format)
    n_tokens = int(plan.lengths[resumed:].sum())
    _, blocks = find_blocks(loaded.model)
    storage = getattr(torch, dtype)
    on_cuda = str(loaded.device).startswith("cuda")
    bar = _progress(cfg.progress, n_tokens, loaded.name)
    n_batches = 0
    thread.start()
    try:
        with torch.inference_mode(), LayerCapture(blocks, layers, early_exit=k is None) as capture:
            for wi, window in todo:
                for positions in window.batches:
                    piece = _run_batch(loaded, ds, plan, cfg, capture, wi, positions, storage, on_cuda, k)
                    thread.put(piece)
                    n_batches += 1
                    bar.update(int(plan.lengths[positions[positions >= resumed]].sum()))
        thread.put(None)
        thread.join()
        thread.raise_error()
        try:
            path = writer.close()
        except OSError as exc:
            raise FormatError(f"publishing the {cfg.format} store failed: {exc}", Path(cfg.out)) from exc
    except BaseException:
        thread.stop()
        thread.join()
        writer.abort()
        raise
    finally:
        bar.close()
    from ..slices import finish_slice

    run_dir, complete = finish_slice(Path(path), cfg.format, cfg.num_machines)
    return ExtractResult(path=Path(path), spec=spec, n_samples=plan.n, resumed_from=resumed, n_tokens=n_tokens,
                         seconds=time.perf_counter() - t0, batches=n_batches, run_dir=run_dir, complete=complete)


def _dataset_root(ds: Dataset, cfg: ExtractConfig) -> Path | None:
    """The dataset on disk for run links: its own root, or a materialised copy (builtin data)."""
    if ds.kind == "image":
        return Path(ds.root) if Path(ds.root).exists() else None
    if cfg.datasets_root is not None:
        root = Path(cfg.datasets_root)
    else:
        from ..runs import shards_root

        root = shards_root().parent / "datasets"
    return materialize_dataset(ds, root)


def _progress(enabled: bool, total: int, name: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="tok", unit_scale=True, disable=not enabled, file=sys.stderr,
                desc=f"extract {Path(name).name}", dynamic_ncols=True, mininterval=0.5)


def _to_device(array: np.ndarray, dev: str, on_cuda: bool) -> Any:
    """Host array -> tensor on `dev`; on CUDA through pinned memory with a non-blocking copy."""
    import torch

    tensor = torch.from_numpy(array)
    return tensor.pin_memory().to(dev, non_blocking=True) if on_cuda else tensor


def _run_batch(loaded: LoadedModel, ds: Dataset, plan: _Plan, cfg: ExtractConfig, capture: LayerCapture, wi: int,
               positions: np.ndarray, storage: Any, on_cuda: bool, k: int | None) -> _Piece:
    """One forward pass over the batch at `positions`; returns what the writer thread needs."""
    import torch

    dev = loaded.device
    model = loaded.model
    token_labels = None
    if loaded.geometry is not None:
        paths = [ds.images[plan.start + int(p)] for p in positions]  # type: ignore[index]
        pixels = _to_device(load_pixels(paths, loaded.geometry), dev, on_cuda).to(next(model.parameters()).dtype)
        starts = np.zeros(len(positions), dtype=np.int64)
        if ds.masks is not None:
            offset = 1 if loaded.cls_token else 0
            token_labels = np.zeros((len(positions), plan.max_tokens), dtype=np.uint8)
            for j, p in enumerate(positions):
                token_labels[j, offset:] = patch_labels(ds.masks[plan.start + int(p)], loaded.geometry)

        def forward() -> Any:
            return model(pixel_values=pixels)
    else:
        assert plan.tokens is not None
        padded = pad_batch([plan.tokens.ids(int(p)) for p in positions], int(loaded.tokenizer.pad_token_id),
                           cfg.padding_side)
        starts = padded.starts
        inputs = {name: _to_device(getattr(padded, name), dev, on_cuda)
                  for name in ("input_ids", "attention_mask", "position_ids")}
        if loaded.causal_lm:
            inputs["use_cache"] = False  # type: ignore[assignment]

        def forward() -> Any:
            return model(**inputs)

    result, outputs = capture.run(forward)
    piece = _Piece(window=wi, positions=positions, starts=starts,
                   layers_host=_cuda_layers(outputs, storage) if on_cuda else _cpu_layers(outputs),
                   token_labels=token_labels)
    if k is not None:
        logits = result.logits.float()
        lengths = torch.from_numpy(padded.lengths).to(dev)
        last = torch.from_numpy(padded.starts).to(dev) + lengths - 1
        at_last = logits[torch.arange(len(positions), device=dev), last]
        values, indices = at_last.topk(int(k), dim=-1)
        ids = inputs["input_ids"]
        logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
        piece.topk_values = values.cpu().numpy()
        piece.topk_indices = indices.cpu().numpy().astype(np.int64)
        piece.logprobs = logp.cpu().numpy()
    return piece
