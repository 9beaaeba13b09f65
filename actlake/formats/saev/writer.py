"""SaevWriter: streaming, resumable, atomically published saev directories."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from ...atomic import WriterLock, remove_tree, write_bytes_atomic, write_json_atomic
from ...batch import Batch
from ...errors import ConfigError, FormatError
from ...spec import StoreSpec
from ...writer import Writer
from .metadata import IGNORE_LABEL, SaevMetadata, metadata_from_spec, shard_name


class SaevWriter(Writer):
    """Streams batches into `acts%06d.bin` shards under `<root>/.tmp-<HASH>` and publishes `<root>/<HASH>`.

    Complete shards are durable (fsynced, renamed from `.partial`) and recorded in
    `progress.json`, so an interrupted writer reopened with the same metadata resumes at the
    first incomplete shard (`resume_from`). Sidecar arrays are preallocated memmaps flushed
    before each shard is committed.
    """

    def __init__(self, root: str | Path, metadata: SaevMetadata, *, token_labels: bool = False,
                 texts: bool = True, provenance: dict[str, Any] | None = None) -> None:
        self.metadata = metadata
        self.root = Path(root)
        self.final_path = self.root / metadata.hash
        self.tmp_path = self.root / f".tmp-{metadata.hash}"
        self._token_labels = token_labels
        self._texts = texts
        self._provenance = provenance or {}
        self._closed = False
        self._counts = metadata.shard_counts()
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock: WriterLock | None = None
        if self.final_path.exists():
            self.resume_from = self._next = metadata.n_examples
            self._closed = True  # identical config already published: nothing to do
            return
        self._lock = WriterLock(self.tmp_path)
        self._open_tmp()

    def _release(self, *, remove: bool) -> None:
        if self._lock is not None:
            self._lock.release(remove=remove)

    @property
    def already_published(self) -> bool:
        return self.final_path.exists() and self._closed

    def _open_tmp(self) -> None:
        md = self.metadata
        tmp = self.tmp_path
        progress_file = tmp / "progress.json"
        complete = 0
        if tmp.exists() and progress_file.exists():
            try:
                state = json.loads(progress_file.read_text())
                on_disk = json.loads((tmp / "metadata.json").read_text())
                complete = int(state["complete_shards"])
                if on_disk != md.to_json() or bool(state.get("token_labels")) != self._token_labels:
                    raise ValueError("different configuration")
            except (ValueError, KeyError, OSError, TypeError):
                remove_tree(tmp)
                complete = 0
        elif tmp.exists():
            remove_tree(tmp)
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / ".texts").mkdir(exist_ok=True)
        if complete == 0:
            write_json_atomic(tmp / "metadata.json", md.to_json())
            self._write_progress(0)
        for stale in tmp.glob("*.partial"):
            stale.unlink()
        for stale in [*tmp.glob(".*.tmp-*"), *(tmp / ".texts").glob(".*.tmp-*")]:
            stale.unlink()  # temp files of an atomic write interrupted by a kill
        n = md.n_examples
        self._lengths = self._sidecar("lengths.bin", np.int32, (n,), fresh=complete == 0)
        self._sample_ids = self._sidecar("sample_ids.bin", np.int64, (n,), fresh=complete == 0)
        self._labels = (
            self._sidecar("labels.bin", np.uint8, (n, md.patches_per_ex), fresh=complete == 0)
            if self._token_labels else None
        )
        self._shard_idx = complete
        self.resume_from = sum(self._counts[:complete])
        self._next = self.resume_from  # next global example position
        self._in_shard = 0
        self._file = None
        self._text_lines: list[str] = []

    def _sidecar(self, name: str, dtype: Any, shape: tuple[int, ...], *, fresh: bool) -> np.ndarray | None:
        path = self.tmp_path / name
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if fresh or not path.exists() or path.stat().st_size != nbytes:
            with open(path, "wb") as f:
                f.truncate(nbytes)
        if nbytes == 0:
            return np.zeros(shape, dtype=dtype)
        return np.memmap(path, dtype=dtype, mode="r+", shape=shape)

    def _write_progress(self, complete: int) -> None:
        write_json_atomic(self.tmp_path / "progress.json",
                          {"complete_shards": complete, "token_labels": self._token_labels})

    def _open_shard(self) -> None:
        self._file = open(self.tmp_path / f"{shard_name(self._shard_idx)}.partial", "wb", buffering=0)
        self._in_shard = 0

    def _commit_shard(self) -> None:
        """Make the current shard durable: sidecars, texts, shard file, then progress.

        The shard file is extended to the full `examples_per_shard` size of spec section 3 even
        when it is the last, short one: upstream saev memmaps every shard at that shape. The
        extension is a file hole (reads as zeros, no bytes written); `shards.json` keeps the real count.
        """
        assert self._file is not None
        for arr in (self._lengths, self._sample_ids, self._labels):
            if isinstance(arr, np.memmap):
                arr.flush()
        if self._texts:
            write_bytes_atomic(self.tmp_path / ".texts" / f"{self._shard_idx:06d}.jsonl",
                               "".join(self._text_lines).encode("utf-8"))
        self._text_lines = []
        # every shard full size (upstream memmaps the full shape): the last one's tail is a hole, no bytes written
        os.ftruncate(self._file.fileno(), self.metadata.shard_bytes)
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        name = shard_name(self._shard_idx)
        os.replace(self.tmp_path / f"{name}.partial", self.tmp_path / name)
        self._shard_idx += 1
        self._write_progress(self._shard_idx)  # its directory fsync also makes the rename above durable

    def write_batch(self, batch: Batch) -> None:
        md = self.metadata
        if not self.accepts(batch, n_layers=len(md.layers), d_model=md.d_model, max_tokens=md.tokens_per_ex,
                            written=self._next, n_samples=md.n_examples, count_name="n_examples"):
            return
        b = batch.size
        if self._token_labels and batch.token_labels is None:
            raise ConfigError("this writer stores labels.bin but the batch has no token_labels")
        acts = np.ascontiguousarray(batch.acts_bltd, dtype=np.float32)
        lengths = np.asarray(batch.lengths, dtype=np.int64)
        start = 0
        while start < b:
            if self._file is None:
                self._open_shard()
            room = self._counts[self._shard_idx] - self._in_shard
            take = min(room, b - start)
            self._write_examples(acts[start : start + take], lengths[start : start + take])
            self._record(batch, start, take)
            self._in_shard += take
            self._next += take
            start += take
            if self._in_shard == self._counts[self._shard_idx]:
                self._commit_shard()

    def _write_examples(self, acts_bltd: np.ndarray, lengths: np.ndarray) -> None:
        """Write examples at the shard's next position: real tokens only.

        Padding is never written: it stays a hole in the file, which reads as zeros (the shard is
        extended to its full size before it is committed), so padding costs neither copies nor
        disk writes, and whatever the model left in padding positions never reaches the file.
        """
        md = self.metadata
        fd = self._file.fileno()
        n_layers, t, t_full = acts_bltd.shape[1], acts_bltd.shape[2], md.tokens_per_ex
        layer_bytes = t_full * md.d_model * 4
        base = self._in_shard * md.example_bytes
        if t == t_full and (lengths == t_full).all():
            _pwrite_all(fd, acts_bltd, base)  # dense: one write for the whole run of examples
            return
        for i, n in enumerate(lengths.tolist()):
            offset = base + i * md.example_bytes
            if n == t_full and t == t_full:
                _pwrite_all(fd, acts_bltd[i], offset)
            elif n:
                for li in range(n_layers):
                    _pwrite_all(fd, acts_bltd[i, li, :n], offset + li * layer_bytes)

    def _record(self, batch: Batch, start: int, take: int) -> None:
        pos = slice(self._next, self._next + take)
        sel = slice(start, start + take)
        self._lengths[pos] = np.asarray(batch.lengths[sel])
        self._sample_ids[pos] = np.asarray(batch.sample_ids[sel])
        if self._labels is not None:
            labels = np.asarray(batch.token_labels[sel])
            offset = 1 if self.metadata.cls_token else 0
            width = self.metadata.patches_per_ex
            got = labels[:, offset : offset + width]
            self._labels[pos, : got.shape[1]] = got
        if self._texts:
            for k in range(take):
                row: dict[str, Any] = {"i": self._next + k, "sample_id": int(batch.sample_ids[start + k])}
                if batch.texts is not None:
                    row["text"] = batch.texts[start + k]
                if batch.labels is not None:
                    row["label"] = int(batch.labels[start + k])
                self._text_lines.append(json.dumps(row, ensure_ascii=False) + "\n")

    def close(self) -> Path:
        if self._closed:
            if self.final_path.exists():
                return self.final_path
            raise FormatError("writer was aborted", self.tmp_path)
        md = self.metadata
        if self._next != md.n_examples:
            raise ConfigError(f"wrote {self._next} examples but metadata says n_examples={md.n_examples}", self.tmp_path)
        tmp = self.tmp_path
        for arr in (self._lengths, self._sample_ids, self._labels):
            if isinstance(arr, np.memmap):
                arr.flush()
        self._lengths = self._sample_ids = self._labels = None  # drop the maps before renaming
        shards = [{"name": shard_name(i), "n_examples": c} for i, c in enumerate(self._counts)]
        write_json_atomic(tmp / "shards.json", shards)
        if self._texts:
            parts = sorted((tmp / ".texts").glob("*.jsonl"))
            with open(tmp / "samples.jsonl", "wb") as out:
                for part in parts:
                    out.write(part.read_bytes())
        remove_tree(tmp / ".texts")
        if not self._token_labels:
            _write_ignore_labels(tmp / "labels.bin", md.n_examples * md.patches_per_ex)
        if self._provenance:
            write_json_atomic(tmp / "provenance.json", self._provenance)
        (tmp / "progress.json").unlink()
        self._closed = True
        try:
            return self.publish(tmp, self.final_path)
        finally:
            self._release(remove=True)

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._closed = True
        self._release(remove=False)


def create_writer(out_root: Path, spec: StoreSpec) -> SaevWriter:
    """Format-registry entry point: `<out_root>/<HASH>`; machine k of M > 1 writes its slice (a complete
    saev directory of its samples) to `<out_root>/saev-<runhash16>/machine_kkkk/<HASH>`."""
    root = Path(out_root)
    if spec.num_machines > 1:  # the slice's own identity names its machine (the run's spec stays in provenance)
        root = root / f"saev-{spec.run_hash()[:16]}" / f"machine_{spec.machine_id:04d}"
        spec = replace(spec, data={**spec.data, "slice": {"machine_id": spec.machine_id,
                                                          "num_machines": spec.num_machines}})
    return SaevWriter(root, metadata_from_spec(spec), token_labels=spec.has_token_labels,
                      provenance=spec.provenance)


def _write_ignore_labels(path: Path, nbytes: int, chunk: int = 1 << 22) -> None:
    """labels.bin of an extraction without per-patch labels (text): every patch IGNORE_LABEL, written
    in bounded chunks and fsynced (the storage spec says every shard directory has labels.bin)."""
    block = bytes([IGNORE_LABEL]) * min(chunk, max(nbytes, 1))
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(block[: min(left, len(block))])
        f.flush()
        os.fsync(f.fileno())


def _pwrite_all(fd: int, array: np.ndarray, offset: int) -> None:
    """Write a C-contiguous array's bytes at `offset`, finishing short writes."""
    view = memoryview(array).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
