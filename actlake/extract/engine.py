"""The extraction engine: one forward pass per batch, hooks on the requested blocks, a background writer.

Flow: load model + dataset -> this machine's slice -> tokenise (lengths fix the store's token
axis) -> StoreSpec -> `create_writer(format, out, spec)` -> skip `writer.resume_from` samples ->
for each length-bucketed batch, forward under `torch.inference_mode()` until the deepest
requested block, hand the captured tensors to a writer thread (bounded queue) that copies them
to host, puts samples back in dataset order and calls `writer.write_batch` -> `writer.close()`.
"""

from __future__ import annotations

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
from ..errors import ConfigError, DatasetError
from ..spec import StoreSpec
from .batching import (
    PADDING_SIDES,
    Tokenized,
    Window,
    machine_slice,
    pad_batch,
    plan_windows,
    tokenize_pairs,
    tokenize_texts,
)
from .datasets import Dataset, DatasetFields, load_pixels, open_dataset, patch_labels
from .layers import LayerCapture, find_blocks, normalize_layers
from .models import LoadedModel, load_model, set_offline

STORAGE_DTYPES = ("float32", "float16")
DEVICES = ("auto", "cpu", "cuda")
LAYER_NUMBERING = "layer l = output of block l = hidden_states[l + 1]; negative indices count from the end"


@dataclass(frozen=True)
class ExtractConfig:
    """Everything one extraction run needs; validated on construction.

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

    def __post_init__(self) -> None:
        if self.max_seq_len < 2:
            raise ConfigError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.dtype is not None and self.dtype not in STORAGE_DTYPES:
            raise ConfigError(f"storage dtype must be one of {STORAGE_DTYPES}, got {self.dtype!r}")
        if self.device not in DEVICES and not str(self.device).startswith("cuda:"):
            raise ConfigError(f"device must be one of {DEVICES} (or cuda:N), got {self.device!r}")
        if self.padding_side not in PADDING_SIDES:
            raise ConfigError(f"padding_side must be one of {PADDING_SIDES}, got {self.padding_side!r}")
        if not 0 <= self.machine_id < self.num_machines:
            raise ConfigError(f"machine_id {self.machine_id} not in [0, {self.num_machines})")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"limit must be >= 1, got {self.limit}")
        if self.queue_depth < 1 or self.bucket_batches < 1:
            raise ConfigError("queue_depth and bucket_batches must be >= 1")
        k = self.options.get("logits_topk")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ConfigError(f"option logits_topk must be a positive integer, got {k!r}")


@dataclass(frozen=True)
class ExtractResult:
    """What a run did: where the store is, and how much work this invocation did."""

    path: Path
    spec: StoreSpec
    n_samples: int
    resumed_from: int
    n_tokens: int
    seconds: float
    batches: int


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when a GPU is visible, else 'cpu'."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but torch sees no CUDA device")
    return device


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
    start, stop, spm = machine_slice(len(ds), cfg.machine_id, cfg.num_machines)
    n = stop - start
    if loaded.geometry is not None:
        t = loaded.geometry.n_patches + (1 if loaded.cls_token else 0)
        lengths = np.full(n, t, dtype=np.int64)
        return _Plan(start, stop, spm, lengths, lengths, None, t, 0)
    assert ds.texts is not None
    texts = ds.texts[start:stop]
    if ds.kind == "prompt_response":
        assert ds.responses is not None
        r_max = cfg.options.get("response_max_tokens")
        tok = tokenize_pairs(loaded.tokenizer, texts, ds.responses[start:stop], cfg.max_seq_len,
                             None if r_max is None else int(r_max))
        response = tok.lengths - tok.prompt_lengths
        p_t = int(tok.prompt_lengths.max()) if n else 1
        r_t = int(r_max) if r_max is not None else (int(response.max()) if n else 1)
        return _Plan(start, stop, spm, tok.lengths, tok.prompt_lengths, tok, max(p_t, 1), max(r_t, 1))
    tok = tokenize_texts(loaded.tokenizer, texts, cfg.max_seq_len)
    t = int(tok.lengths.max()) if n else 1
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
        "machine_id": cfg.machine_id,
        "num_machines": cfg.num_machines,
        "samples_per_machine": plan.samples_per_machine,
        "sample_range": [plan.start, plan.stop],
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
    return StoreSpec(
        layers=layers, d_model=loaded.d_model, max_tokens=plan.max_tokens, n_samples=plan.n,
        model_name=loaded.name, family=loaded.family, cls_token=loaded.cls_token, dataset=ds.root, data=data,
        provenance=provenance, dtype=dtype, machine_id=cfg.machine_id, num_machines=cfg.num_machines,
        has_token_labels=vision and ds.has_masks, options=dict(cfg.options),
    )


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


class _WriterThread(threading.Thread):
    """Reassembles windows in dataset order and feeds `writer.write_batch` behind a bounded queue."""

    def __init__(self, writer: Any, ds: Dataset, plan: _Plan, windows: list[Window], spec: StoreSpec,
                 skip_below: int, chunk: int, depth: int) -> None:
        super().__init__(name="actlake-writer", daemon=True)
        self.writer, self.ds, self.plan, self.windows, self.spec = writer, ds, plan, windows, spec
        self.skip_below, self.chunk = skip_below, chunk
        self.queue: queue.Queue[_Piece | None] = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self._stop_now = threading.Event()
        self._pending: list[_Piece] = []
        self.np_dtype = np.dtype(spec.dtype)

    def put(self, piece: _Piece | None) -> None:
        """Hand over a piece (None = end); re-raise the thread's error instead of blocking forever."""
        while True:
            if self.error is not None:
                raise self.error
            try:
                self.queue.put(piece, timeout=0.1)
                return
            except queue.Full:
                if not self.is_alive():
                    raise RuntimeError("writer thread stopped") from self.error

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
                self._pending.append(piece)
                window = self.windows[piece.window]
                if len(self._pending) == len(window.batches):
                    self._flush(window)
                    self._pending = []
        except BaseException as exc:  # noqa: BLE001 - handed to the model thread
            self.error = exc

    def _flush(self, window: Window) -> None:
        pieces = self._pending
        hosts = [p.layers_host() for p in pieces]
        n_w = window.stop - window.start
        owner = np.empty(n_w, dtype=np.int64)
        row = np.empty(n_w, dtype=np.int64)
        for k, p in enumerate(pieces):
            owner[p.positions - window.start] = k
            row[p.positions - window.start] = np.arange(len(p.positions))
        first = max(window.start, self.skip_below)
        for c in range(first, window.stop, self.chunk):
            if self._stop_now.is_set():
                return
            positions = np.arange(c, min(c + self.chunk, window.stop))
            self.writer.write_batch(self._batch(positions, pieces, hosts, owner, row, window.start))

    def _batch(self, positions: np.ndarray, pieces: list[_Piece], hosts: list[list[np.ndarray]], owner: np.ndarray,
               row: np.ndarray, w0: int) -> Batch:
        plan, ds, spec = self.plan, self.ds, self.spec
        n, n_layers, t, d = len(positions), len(spec.layers), spec.max_tokens, spec.d_model
        acts = np.zeros((n, n_layers, t, d), dtype=self.np_dtype)
        resp = np.zeros((n, n_layers, plan.response_tokens, d), dtype=self.np_dtype) if plan.response_tokens else None
        p_len = plan.prompt_lengths[positions]
        r_len = plan.lengths[positions] - p_len
        token_labels = np.zeros((n, t), dtype=np.uint8) if spec.has_token_labels else None
        k = int(spec.options.get("logits_topk") or 0)
        top_v = np.zeros((n, k), dtype=np.float32) if k else None
        top_i = np.zeros((n, k), dtype=np.int64) if k else None
        ppl: list[list[float]] = []
        for j, pos in enumerate(positions):
            piece, r = pieces[owner[pos - w0]], int(row[pos - w0])
            s, p, q = int(piece.starts[r]), int(p_len[j]), int(r_len[j])
            for li, arr in enumerate(hosts[owner[pos - w0]]):
                acts[j, li, :p] = arr[r, s : s + p]
                if resp is not None and q:
                    resp[j, li, :q] = arr[r, s + p : s + p + q]
            if token_labels is not None and piece.token_labels is not None:
                token_labels[j] = piece.token_labels[r]
            if k:
                assert piece.topk_values is not None and piece.topk_indices is not None and top_v is not None
                top_v[j], top_i[j] = piece.topk_values[r], piece.topk_indices[r]  # type: ignore[index]
                assert piece.logprobs is not None
                lp = piece.logprobs[r, s : s + p + q - 1].astype(np.float64)
                ppl.append([float(x) for x in np.exp(-lp)])
        g = plan.start + positions  # = machine_id * samples_per_machine + local_idx
        token_ids = None
        texts = responses = None
        extra: dict[str, Any] = {}
        if plan.tokens is not None:
            token_ids = np.zeros((n, t), dtype=np.int64)
            for j, pos in enumerate(positions):
                token_ids[j, : p_len[j]] = plan.tokens.ids(int(pos))[: p_len[j]]
            assert ds.texts is not None
            texts = [ds.texts[int(i)] for i in g]
            if ds.responses is not None:
                responses = [ds.responses[int(i)] for i in g]
            extra["truncated"] = [bool(x) for x in plan.tokens.truncated[positions]]
        if ds.ids is not None:
            extra["id"] = [str(ds.ids[int(i)]) for i in g]
        if k:
            extra["token_perplexity"] = ppl
        return Batch(
            acts_bltd=acts, lengths=p_len.astype(np.int64), sample_ids=g.astype(np.int64), texts=texts,
            labels=None if ds.labels is None else ds.labels[g], token_labels=token_labels, token_ids=token_ids,
            response_bltd=resp, response_lengths=None if resp is None else r_len.astype(np.int64),
            response_texts=responses, logits_topk_values=top_v, logits_topk_indices=top_i, extra=extra,
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
    ds = dataset or open_dataset(cfg.data, cfg.fields, limit=cfg.limit)
    _check_match(loaded, ds)
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
    writer = create_writer(cfg.format, Path(cfg.out), spec)
    resumed = min(int(writer.resume_from), plan.n)
    windows = plan_windows(plan.lengths, cfg.batch_size, cfg.bucket_batches)
    todo = [(i, w) for i, w in enumerate(windows) if w.stop > resumed]
    thread = _WriterThread(writer, ds, plan, windows, spec, resumed, cfg.batch_size, cfg.queue_depth)
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
        if thread.error is not None:
            raise thread.error
        path = writer.close()
    except BaseException:
        thread.stop()
        thread.join()
        writer.abort()
        raise
    finally:
        bar.close()
    return ExtractResult(path=Path(path), spec=spec, n_samples=plan.n, resumed_from=resumed, n_tokens=n_tokens,
                         seconds=time.perf_counter() - t0, batches=n_batches)


def _progress(enabled: bool, total: int, name: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="tok", unit_scale=True, disable=not enabled, file=sys.stderr,
                desc=f"extract {Path(name).name}", dynamic_ncols=True, mininterval=0.5)


def _run_batch(loaded: LoadedModel, ds: Dataset, plan: _Plan, cfg: ExtractConfig, capture: LayerCapture, wi: int,
               positions: np.ndarray, storage: Any, on_cuda: bool, k: int | None) -> _Piece:
    """One forward pass over the batch at `positions`; returns what the writer thread needs."""
    import torch

    dev = loaded.device
    model = loaded.model
    token_labels = None
    if loaded.geometry is not None:
        paths = [ds.images[plan.start + int(p)] for p in positions]  # type: ignore[index]
        pixels = torch.from_numpy(load_pixels(paths, loaded.geometry))
        pixels = pixels.to(device=dev, dtype=next(model.parameters()).dtype, non_blocking=True)
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
        inputs = {
            "input_ids": torch.from_numpy(padded.input_ids).to(dev, non_blocking=True),
            "attention_mask": torch.from_numpy(padded.attention_mask).to(dev, non_blocking=True),
            "position_ids": torch.from_numpy(padded.position_ids).to(dev, non_blocking=True),
        }
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
