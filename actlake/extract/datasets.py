"""Datasets the engine reads: text files, JSONL, Parquet, `load_from_disk` dirs, image folders, builtin corpus.

Every dataset is loaded into plain columns (texts are small next to their activations; images
stay paths until their batch is loaded) and carries a content fingerprint: the sha256 of its
records in order, independent of the file format they came from. Empty or whitespace-only texts
are skipped (their original position stays in `ids`).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import platform
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from ..errors import ConfigError, DatasetError
from ..hashing import file_sha256

BUILTIN_PREFIX = "builtin:"
STDLIB_DOCS = "builtin:stdlib-docs"
BUILTINS = (STDLIB_DOCS,)
STDLIB_MIN_CHARS = 40
STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
MASKS_DIRNAME = "masks"
KINDS = ("text", "prompt_response", "image")


@dataclass(frozen=True)
class DatasetFields:
    """Which record fields to read. `None` for label/id means: use 'label'/'id' when present."""

    text: str = "text"
    prompt: str | None = None
    response: str | None = None
    label: str | None = None
    id: str | None = None
    split: str | None = None
    masks: str | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) != (self.response is None):
            raise ConfigError("prompt and response fields come together (set both or neither)")

    def describe(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass(frozen=True, eq=False)
class Dataset:
    """A dataset in memory: per-sample columns, its content fingerprint and a plain description.

    kind 'text': `texts`; 'prompt_response': `texts` are prompts, `responses` the responses;
    'image': `images` (paths) and optional `masks`. `labels` int64 (-1 = none) when present.
    """

    spec: str
    kind: str
    root: str
    source_format: str
    fingerprint: str
    texts: tuple[str, ...] | None = None
    responses: tuple[str, ...] | None = None
    labels: np.ndarray | None = None
    label_names: tuple[str, ...] | None = None
    ids: tuple[Any, ...] | None = None
    images: tuple[Path, ...] | None = None
    masks: tuple[Path, ...] | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"dataset kind must be one of {KINDS}, got {self.kind!r}")
        n = len(self)
        for name in ("responses", "labels", "ids", "masks"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ConfigError(f"dataset column {name} has {len(value)} entries, expected {n}")

    def __len__(self) -> int:
        column = self.images if self.kind == "image" else self.texts
        return len(column or ())

    @property
    def has_masks(self) -> bool:
        return self.masks is not None

    def describe(self) -> dict[str, Any]:
        """Plain-data description (hashed into a store's identity)."""
        out: dict[str, Any] = {
            "spec": self.root, "kind": self.kind, "format": self.source_format, "n_samples": len(self),
            "fingerprint": self.fingerprint,
        }
        if self.label_names is not None:
            out["label_names"] = list(self.label_names)
        out.update(self.details)
        return out


# ------------------------------------------------------------------------------------------
# fingerprints
# ------------------------------------------------------------------------------------------


class _Fingerprint:
    """sha256 over one canonical JSON line per record."""

    def __init__(self, kind: str) -> None:
        self._h = hashlib.sha256(f"actlake-dataset-v1\0{kind}\n".encode())

    def add(self, record: dict[str, Any]) -> None:
        self._h.update(json.dumps(record, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8"))
        self._h.update(b"\n")

    def hexdigest(self) -> str:
        return self._h.hexdigest()


# ------------------------------------------------------------------------------------------
# records -> columns
# ------------------------------------------------------------------------------------------


def _encode_labels(raw: list[Any], source: Path | str) -> tuple[np.ndarray, tuple[str, ...] | None]:
    """int64 labels (-1 = none); string labels become indices into their sorted unique names."""
    if any(isinstance(x, str) for x in raw):
        names = tuple(sorted({str(x) for x in raw if x is not None}))
        index = {n: i for i, n in enumerate(names)}
        return np.array([-1 if x is None else index[str(x)] for x in raw], dtype=np.int64), names
    out = np.empty(len(raw), dtype=np.int64)
    for i, x in enumerate(raw):
        if x is None:
            out[i] = -1
        elif isinstance(x, (bool, int, np.integer)) or (isinstance(x, float) and float(x).is_integer()):
            out[i] = int(x)
        else:
            raise DatasetError(f"label of record {i} is {x!r}: labels must be integers or strings", source)
    return out, None


def _from_records(records: Iterable[tuple[Any, dict[str, Any]]], fields: DatasetFields, *, spec: str, root: str,
                  source_format: str, source: Path | str, limit: int | None,
                  details: dict[str, Any] | None = None) -> Dataset:
    """Columns from (position, record) pairs: text or prompt+response, label, id; empties skipped."""
    texts: list[str] = []
    responses: list[str] = []
    labels: list[Any] = []
    ids: list[Any] = []
    label_field, id_field = fields.label, fields.id
    pair = fields.prompt is not None
    first = True
    skipped = 0
    for position, record in records:
        if limit is not None and len(texts) >= limit:
            break
        if not isinstance(record, dict):
            raise DatasetError(f"record {position} is not an object", source)
        if first:
            if not pair and fields.text not in record and "prompt" in record and "response" in record:
                fields = DatasetFields(text=fields.text, prompt="prompt", response="response", label=fields.label,
                                       id=fields.id, split=fields.split)
                pair = True
            label_field = label_field if label_field is not None else ("label" if "label" in record else None)
            id_field = id_field if id_field is not None else ("id" if "id" in record else None)
            first = False
        main = fields.prompt if pair else fields.text
        assert main is not None
        if main not in record:
            raise DatasetError(f"record {position} has no field {main!r} (fields: {sorted(record)[:10]})", source)
        text = record[main]
        if not isinstance(text, str):
            raise DatasetError(f"field {main!r} of record {position} is {type(text).__name__}, not a string", source)
        if not text.strip():
            skipped += 1
            continue
        texts.append(text)
        if pair:
            assert fields.response is not None
            response = record.get(fields.response)
            if not isinstance(response, str):
                raise DatasetError(f"field {fields.response!r} of record {position} is missing or not a string", source)
            responses.append(response)
        if label_field is not None:
            if label_field not in record:
                raise DatasetError(f"record {position} has no label field {label_field!r}", source)
            labels.append(record[label_field])
        ids.append(record[id_field] if id_field is not None and id_field in record else position)
    if not texts:
        raise DatasetError("dataset holds no non-empty texts", source)
    label_array, label_names = _encode_labels(labels, source) if label_field is not None else (None, None)
    kind = "prompt_response" if pair else "text"
    fp = _Fingerprint(kind)
    for i, text in enumerate(texts):
        rec: dict[str, Any] = {"text": text, "id": ids[i]}
        if pair:
            rec["response"] = responses[i]
        if label_array is not None:
            rec["label"] = labels[i]
        fp.add(rec)
    used = {"text": fields.prompt if pair else fields.text}
    if pair:
        used["response"] = fields.response or "response"
    if label_field:
        used["label"] = label_field
    if id_field:
        used["id"] = id_field
    extra = dict(details or {})
    extra["fields"] = used
    extra["skipped_empty"] = skipped
    if limit is not None:
        extra["limit"] = limit
    return Dataset(spec=spec, kind=kind, root=root, source_format=source_format, fingerprint=fp.hexdigest(),
                   texts=tuple(texts), responses=tuple(responses) if pair else None, labels=label_array,
                   label_names=label_names, ids=tuple(ids), details=extra)


# ------------------------------------------------------------------------------------------
# readers
# ------------------------------------------------------------------------------------------


def _read_txt(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """One record per newline-terminated line (streamed; only '\n' / '\r\n' end a line)."""
    with open(path, encoding="utf-8", newline="") as f:
        try:
            for lineno, line in enumerate(f, 1):
                yield lineno, {"text": line.rstrip("\r\n")}
        except UnicodeDecodeError as exc:
            raise DatasetError(f"not UTF-8 text: {exc}", path) from exc


def _read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with open(path, encoding="utf-8") as f:
        try:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DatasetError(f"line {lineno} is not JSON: {exc}", path) from exc
        except UnicodeDecodeError as exc:
            raise DatasetError(f"not UTF-8 text: {exc}", path) from exc


def _wanted_columns(names: Iterable[str], fields: DatasetFields) -> list[str] | None:
    """The columns a record can be read from (so image or embedding columns are never decoded); None: all.

    All columns are kept when the text field is absent, so the missing-field error lists them.
    """
    names = list(names)
    wanted = {fields.text, fields.prompt, fields.response, fields.label or "label", fields.id or "id",
              "prompt", "response"}
    keep = [n for n in names if n in wanted]
    main = fields.prompt or fields.text
    return keep if main in keep or {"prompt", "response"} <= set(keep) else None


def _read_parquet(path: Path, fields: DatasetFields) -> Iterator[tuple[int, dict[str, Any]]]:
    """Rows of the columns `_wanted_columns` picks, one record batch at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        columns = _wanted_columns(pf.schema_arrow.names, fields)
        i = 0
        for batch in pf.iter_batches(columns=columns):
            for row in batch.to_pylist():
                yield i, row
                i += 1
    except (pa.ArrowInvalid, OSError) as exc:
        raise DatasetError(f"not a readable Parquet file: {exc}", path) from exc


def _is_hf_disk_dir(path: Path) -> bool:
    return any((path / name).is_file() for name in ("dataset_info.json", "state.json", "dataset_dict.json"))


def _read_hf_disk(path: Path, fields: DatasetFields) -> tuple[Iterator[tuple[int, dict[str, Any]]], str]:
    import datasets as hf

    try:
        ds = hf.load_from_disk(str(path))
    except (FileNotFoundError, OSError, ValueError) as exc:
        raise DatasetError(f"not a datasets.load_from_disk directory: {exc}", path) from exc
    split = fields.split
    if isinstance(ds, hf.DatasetDict):
        names = list(ds.keys())
        chosen = split or ("train" if "train" in ds else (names[0] if len(names) == 1 else None))
        if chosen is None or chosen not in ds:
            raise DatasetError(f"choose a split with --split (splits: {names})", path)
        ds, split = ds[chosen], chosen
    columns = _wanted_columns(ds.column_names, fields)
    if columns is not None:
        ds = ds.select_columns(columns)
    return ((i, row) for i, row in enumerate(ds)), split or ""


def list_images(root: Path, masks: Path | None = None) -> list[Path]:
    """Image files under `root` in sorted relative-path order (= sample order), minus the mask tree.

    `masks` defaults to `<root>/masks`; the engine and the visuals both number images this way.
    """
    root = Path(root)
    mask_root = Path(masks) if masks is not None else root / MASKS_DIRNAME
    files = [p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
             and mask_root not in p.parents]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _read_image_folder(path: Path, fields: DatasetFields, spec: str, limit: int | None) -> Dataset:
    """Images under `path`; class subfolders give labels; a mask tree (same relative paths) gives token labels."""
    mask_root = Path(fields.masks).expanduser().resolve() if fields.masks else path / MASKS_DIRNAME
    if fields.masks and not mask_root.is_dir():
        raise DatasetError("mask directory does not exist", mask_root)
    has_masks = mask_root.is_dir()
    images = list_images(path, mask_root)
    if not images:
        raise DatasetError(f"no images ({', '.join(IMAGE_SUFFIXES)}) found", path)
    classes = sorted({p.relative_to(path).parts[0] for p in images if len(p.relative_to(path).parts) > 1})
    if limit is not None:
        images = images[:limit]
    class_index = {c: i for i, c in enumerate(classes)}
    labels = np.array([class_index.get(p.relative_to(path).parts[0], -1) if len(p.relative_to(path).parts) > 1
                       else -1 for p in images], dtype=np.int64)
    masks: list[Path] | None = None
    if has_masks:
        masks = []
        for p in images:
            rel = p.relative_to(path).with_suffix("")
            found = [mask_root / rel.with_suffix(s) for s in (".png",) + IMAGE_SUFFIXES if (mask_root / rel.with_suffix(s)).is_file()]
            if not found:
                raise DatasetError(f"no mask for image {p.relative_to(path)} under {mask_root}", p)
            masks.append(found[0])
    fp = _Fingerprint("image")
    for i, p in enumerate(images):
        rec: dict[str, Any] = {"path": p.relative_to(path).as_posix(), "sha256": file_sha256(p), "label": int(labels[i])}
        if masks is not None:
            rec["mask_sha256"] = file_sha256(masks[i])
        fp.add(rec)
    details: dict[str, Any] = {"classes": classes}
    if masks is not None:
        details["masks"] = str(mask_root)
    if limit is not None:
        details["limit"] = limit
    return Dataset(spec=spec, kind="image", root=str(path), source_format="image-folder", fingerprint=fp.hexdigest(),
                   labels=labels if classes else None, label_names=tuple(classes) if classes else None,
                   ids=tuple(p.relative_to(path).as_posix() for p in images), images=tuple(images),
                   masks=tuple(masks) if masks is not None else None, details=details)


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def iter_stdlib_docstrings(min_chars: int = STDLIB_MIN_CHARS) -> Iterator[tuple[str, str]]:
    """(where, docstring) for every module/class/function docstring in the stdlib, in a fixed order.

    Files in sorted relative-path order (test suites and site-packages skipped), nodes in
    `ast.walk` order, `inspect.cleandoc`-cleaned, at least `min_chars` long, first occurrence only.
    Parsed with `ast`, never imported, so nothing runs.
    """
    root = stdlib_root()
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in STDLIB_SKIP_DIRS and not d.startswith("."))
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    seen: set[str] = set()
    for f in files:
        try:
            tree = ast.parse(f.read_bytes(), filename=str(f))
        except (SyntaxError, ValueError, OSError):
            continue
        rel = f.relative_to(root).as_posix()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=True)
                if doc and len(doc) >= min_chars and doc not in seen:
                    seen.add(doc)
                    name = getattr(node, "name", "<module>")
                    yield f"{rel}:{name}", doc


def _read_builtin(spec: str, fields: DatasetFields, limit: int | None) -> Dataset:
    if spec != STDLIB_DOCS:
        raise DatasetError(f"unknown builtin dataset; known: {', '.join(BUILTINS)}", spec)
    records = ((where, {"text": doc, "id": where}) for where, doc in iter_stdlib_docstrings())
    details = {"python_version": platform.python_version(), "python_implementation": platform.python_implementation(),
               "min_chars": STDLIB_MIN_CHARS}
    return _from_records(records, DatasetFields(), spec=spec, root=spec, source_format="builtin",
                         source=spec, limit=limit, details=details)


def open_dataset(spec: str | Path, fields: DatasetFields | None = None, *, limit: int | None = None) -> Dataset:
    """Open a dataset by spec: a .txt/.jsonl/.parquet file, a load_from_disk or image dir, or `builtin:...`."""
    fields = fields or DatasetFields()
    if limit is not None and limit < 1:
        raise ConfigError(f"limit must be >= 1, got {limit}")
    text = str(spec)
    if text.startswith(BUILTIN_PREFIX):
        return _read_builtin(text, fields, limit)
    path = Path(text).expanduser()
    if not path.exists():
        raise DatasetError("no such dataset file or directory", path)
    path = path.resolve()
    common = dict(spec=text, root=str(path), source=path, limit=limit)
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".txt":
            return _from_records(_read_txt(path), DatasetFields(), source_format="txt", **common)  # type: ignore[arg-type]
        if suffix in (".jsonl", ".ndjson"):
            return _from_records(_read_jsonl(path), fields, source_format="jsonl", **common)  # type: ignore[arg-type]
        if suffix == ".parquet":
            return _from_records(_read_parquet(path, fields), fields, source_format="parquet", **common)  # type: ignore[arg-type]
        raise DatasetError(f"unknown dataset file type {suffix!r} (use .txt, .jsonl, .parquet)", path)
    if _is_hf_disk_dir(path):
        records, split = _read_hf_disk(path, fields)
        return _from_records(records, fields, source_format="hf-disk", details={"split": split} if split else None,
                             **common)  # type: ignore[arg-type]
    return _read_image_folder(path, fields, text, limit)


# ------------------------------------------------------------------------------------------
# images and masks
# ------------------------------------------------------------------------------------------


def _fit(img: Any, geometry: Any, resample: int) -> Any:
    """Resize (short side + centre crop when the geometry says so, else straight) to the model input."""
    h, w = geometry.height, geometry.width
    if geometry.shortest_edge:
        scale = geometry.shortest_edge / min(img.size)
        img = img.resize((max(w, round(img.size[0] * scale)), max(h, round(img.size[1] * scale))), resample)
        left, top = (img.size[0] - w) // 2, (img.size[1] - h) // 2
        return img.crop((left, top, left + w, top + h))
    return img.resize((w, h), resample)


def load_pixels(paths: Iterable[Path], geometry: Any) -> np.ndarray:
    """[B, 3, H, W] float32 model input: RGB, fitted, rescaled and normalised per the geometry."""
    from PIL import Image, UnidentifiedImageError

    out = []
    mean = np.asarray(geometry.mean, dtype=np.float32)[:, None, None]
    std = np.asarray(geometry.std, dtype=np.float32)[:, None, None]
    for path in paths:
        try:
            with Image.open(path) as img:
                fitted = _fit(img.convert("RGB"), geometry, Image.Resampling.BICUBIC)
        except (UnidentifiedImageError, OSError) as exc:
            raise DatasetError(f"cannot read image: {exc}", path) from exc
        chw = np.asarray(fitted, dtype=np.float32).transpose(2, 0, 1) * np.float32(geometry.rescale)
        out.append((chw - mean) / std)
    return np.stack(out).astype(np.float32, copy=False)


def patch_labels(mask_path: Path, geometry: Any) -> np.ndarray:
    """[n_patches] uint8: the majority mask value in each patch (ties: the smallest value), row-major."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(mask_path) as img:
            if img.mode not in ("L", "P", "1"):
                img = img.convert("L") if img.mode in ("RGB", "RGBA", "LA") else img
            fitted = _fit(img, geometry, Image.Resampling.NEAREST)
            mask = np.asarray(fitted)
    except (UnidentifiedImageError, OSError) as exc:
        raise DatasetError(f"cannot read mask: {exc}", mask_path) from exc
    if mask.ndim != 2 or mask.min() < 0 or mask.max() > 255:
        raise DatasetError("a mask must be a single-channel image with values 0..255", mask_path)
    ps = geometry.patch_size
    gh, gw = geometry.height // ps, geometry.width // ps
    patches = mask.astype(np.int64).reshape(gh, ps, gw, ps).transpose(0, 2, 1, 3).reshape(gh * gw, ps * ps)
    counts = np.zeros((gh * gw, 256), dtype=np.int64)
    np.add.at(counts, (np.repeat(np.arange(gh * gw), ps * ps), patches.reshape(-1)), 1)
    return counts.argmax(axis=1).astype(np.uint8)


# ------------------------------------------------------------------------------------------
# held-out splits (train / val by a hash of the sample key)
# ------------------------------------------------------------------------------------------

SPLITS = ("all", "train", "val")


def check_split(split: str, val_fraction: float) -> None:
    """ConfigError unless `split` is known and a train/val split has a fraction strictly between 0 and 1."""
    if split not in SPLITS:
        raise ConfigError(f"split must be one of {SPLITS}, got {split!r}")
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
        raise ConfigError(f"val_fraction must be a number in [0, 1), got {val_fraction!r}")
    if split != "all" and not 0 < val_fraction < 1:
        raise ConfigError(f"split {split!r} needs 0 < val_fraction < 1, got {val_fraction!r}")


def held_out(sample_key: Any, val_fraction: float) -> bool:
    """Whether a sample is in the val split: the first 64 bits of sha256(str(key)) as a fraction of 2**64."""
    return int(hashlib.sha256(str(sample_key).encode()).hexdigest()[:16], 16) / 2**64 < val_fraction


def sample_keys(ds: Dataset) -> list[Any]:
    """The key each sample is split by: its `ids` entry (the id column, else its position), else its index."""
    return list(ds.ids) if ds.ids is not None else list(range(len(ds)))


def select_split(ds: Dataset, split: str, val_fraction: float) -> Dataset:
    """The rows of `split` as a new Dataset ('all': `ds` itself); `ids` keep the parent's keys for lineage."""
    check_split(split, val_fraction)
    if split == "all":
        return ds
    keys = sample_keys(ds)
    want_val = split == "val"
    rows = [i for i, key in enumerate(keys) if held_out(key, val_fraction) == want_val]
    if not rows:
        raise DatasetError(f"split {split!r} with val_fraction={val_fraction} holds no samples of the "
                           f"{len(ds)} in the dataset", ds.root)

    def pick(column: Any) -> Any:
        if column is None:
            return None
        if isinstance(column, np.ndarray):
            return column[np.asarray(rows, dtype=np.int64)]
        return tuple(column[i] for i in rows)

    blob = json.dumps({"parent": ds.fingerprint, "split": split, "val_fraction": float(val_fraction)},
                      sort_keys=True).encode("utf-8")
    holdout = {"split": split, "val_fraction": float(val_fraction), "parent_fingerprint": ds.fingerprint,
               "parent_n_samples": len(ds)}
    return Dataset(spec=ds.spec, kind=ds.kind, root=ds.root, source_format=ds.source_format,
                   fingerprint=hashlib.sha256(blob).hexdigest(), texts=pick(ds.texts), responses=pick(ds.responses),
                   labels=pick(ds.labels), label_names=ds.label_names, ids=tuple(keys[i] for i in rows),
                   images=pick(ds.images), masks=pick(ds.masks), details={**ds.details, "holdout": holdout})


# ------------------------------------------------------------------------------------------
# a copy on disk (so a run directory's dataset link has a target)
# ------------------------------------------------------------------------------------------

MATERIALIZED_RECORDS = "records.jsonl"
MATERIALIZED_INFO = "dataset.json"


def _is_file_dataset(ds: Dataset) -> bool:
    return not ds.root.startswith(BUILTIN_PREFIX) and Path(ds.root).is_absolute() and Path(ds.root).exists()


def materialize_dataset(ds: Dataset, root: str | Path) -> Path:
    """A readable copy of `ds` on disk: its existing root for a file/dir dataset, else `root/<name>-<fp16>/`.

    The copy holds `records.jsonl` (one object per sample: text, id, and response / label /
    label_name where present, in sample order) and `dataset.json` (the description and
    fingerprint). Written under a temporary name and published atomically; an existing copy is
    returned as is (its name is content-addressed).
    """
    from ..atomic import publish_dir, remove_tree, write_bytes_atomic, write_json_atomic

    if _is_file_dataset(ds):
        return Path(ds.root)
    if ds.kind == "image":
        raise DatasetError("an image dataset without a folder on disk cannot be materialised", ds.root)
    name = ds.spec[len(BUILTIN_PREFIX):] if ds.spec.startswith(BUILTIN_PREFIX) else Path(ds.spec).name
    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in name).strip(".-") or "dataset"
    root = Path(root)
    final = root / f"{name}-{ds.fingerprint[:16]}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    remove_tree(tmp)
    tmp.mkdir()
    try:
        assert ds.texts is not None
        lines = []
        for i, text in enumerate(ds.texts):
            rec: dict[str, Any] = {"text": text, "id": None if ds.ids is None else ds.ids[i]}
            if ds.responses is not None:
                rec["response"] = ds.responses[i]
            if ds.labels is not None:
                rec["label"] = int(ds.labels[i])
                if ds.label_names is not None and ds.labels[i] >= 0:
                    rec["label_name"] = ds.label_names[int(ds.labels[i])]
            lines.append(json.dumps(rec, ensure_ascii=False, default=str) + "\n")
        write_bytes_atomic(tmp / MATERIALIZED_RECORDS, "".join(lines).encode("utf-8"))
        write_json_atomic(tmp / MATERIALIZED_INFO, {"dataset": ds.describe(), "spec": ds.spec,
                                                     "records": MATERIALIZED_RECORDS})
        return publish_dir(tmp, final)
    except BaseException:
        remove_tree(tmp)
        raise
