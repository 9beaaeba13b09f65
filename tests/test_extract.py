"""Extraction engine: activations equal output_hidden_states, early exit, padding, slices, resume, datasets, errors.

Stored stores are read back with plain json + numpy (saev layout), never only through actlake's reader.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import actlake
from actlake.batch import Batch
from actlake.errors import ConfigError, DatasetError, ModelNotFoundError
from actlake.extract import (
    DatasetFields,
    ExtractConfig,
    extract,
    load_model,
    machine_slice,
    normalize_layers,
    open_dataset,
    plan_windows,
    resolve_model,
)
from actlake.extract.batching import pad_batch, tokenize_texts
from actlake.extract.datasets import load_pixels
from actlake.extract.layers import find_blocks, parse_layers
from actlake.formats import FORMAT_MODULES
from actlake.writer import Writer

REPO = Path(__file__).resolve().parents[1]
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello.",
    "A much longer sentence that keeps going, with commas, clauses and several more words than the others here.",
    "Short one",
    "Activations are stored on disk so that training does not rerun the model.",
    "Padding must never leak into stored tokens.",
    "x",
    "Numbers 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32 33",
    "Another line of ordinary English text.",
    "Ten.",
    "The eleventh sample is medium sized, neither long nor short.",
]
_MODELS: dict[str, Any] = {}


def model(arch: str) -> Any:
    """One tiny-random model per architecture per test session."""
    if arch not in _MODELS:
        _MODELS[arch] = load_model(f"tiny-random:{arch}", device="cpu")
    return _MODELS[arch]


def read_saev(path: Path) -> dict[str, Any]:
    """A saev directory read with plain json + numpy: metadata, acts [N, L, T, D], sidecars."""
    md = json.loads((path / "metadata.json").read_text())
    shards = json.loads((path / "shards.json").read_text())
    t = md["patches_per_ex"] + (1 if md["cls_token"] else 0)
    shape = (len(md["layers"]), t, md["d_model"])
    parts = [np.fromfile(path / s["name"], dtype=np.float32).reshape(-1, *shape)[: s["n_examples"]] for s in shards]
    acts = np.concatenate(parts) if parts else np.zeros((0, *shape), np.float32)
    out = {"md": md, "acts": acts, "lengths": np.fromfile(path / "lengths.bin", dtype=np.int32),
           "sample_ids": np.fromfile(path / "sample_ids.bin", dtype=np.int64),
           "samples": [json.loads(x) for x in (path / "samples.jsonl").read_text().splitlines()]}
    if (path / "labels.bin").exists():
        out["labels"] = np.fromfile(path / "labels.bin", dtype=np.uint8).reshape(len(acts), md["patches_per_ex"])
    out["provenance"] = json.loads((path / "provenance.json").read_text())
    return out


@pytest.fixture
def txt_file(tmp_path: Path) -> Path:
    f = tmp_path / "texts.txt"
    f.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    return f


def make_images(root: Path, n_per_class: int = 3, masks: bool = False) -> Path:
    """Class subfolders of small random RGB images (varied sizes), optionally with masks."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for c, cls in enumerate(("cat", "dog")):
        for i in range(n_per_class):
            h, w = (32, 32) if i % 2 == 0 else (40, 48)
            arr = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            (root / "images" / cls).mkdir(parents=True, exist_ok=True)
            Image.fromarray(arr).save(root / "images" / cls / f"{i}.png")
            if masks:
                m = np.zeros((32, 32), dtype=np.uint8)
                m[:, :16] = 1 + c  # left half the class, right half background
                m[:8, 16:24] = 7  # one patch (row 0, col 2) fully 7
                m[8:16, 24:32] = 3  # patch (1, 3): 3 wins...
                m[8:11, 24:32] = 5  # ...over 5 (24 vs 40 pixels: 5 has 24, 3 has 40)
                (root / "images" / "masks" / cls).mkdir(parents=True, exist_ok=True)
                Image.fromarray(m, mode="L").save(root / "images" / "masks" / cls / f"{i}.png")
    return root / "images"


def run_extract(tmp_path: Path, arch: str, data: Any, name: str = "out", **kw: Any) -> tuple[Path, dict[str, Any]]:
    cfg = ExtractConfig(model=f"tiny-random:{arch}", data=str(data), out=tmp_path / name,
                        **{"batch_size": 4, "bucket_batches": 2, "max_seq_len": 24, "device": "cpu", **kw})
    result = extract(cfg, model=model(arch))
    assert actlake.verify(result.path) == []
    return result.path, read_saev(result.path)


# ------------------------------------------------------------------------------------------
# correctness against output_hidden_states
# ------------------------------------------------------------------------------------------

FINAL_NORM = {"gpt2": "transformer.ln_f", "llama": "model.norm", "qwen2": "model.norm"}


@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert", "qwen2"])
def test_text_activations_equal_hidden_states(tmp_path: Path, txt_file: Path, arch: str) -> None:
    lm = model(arch)
    path, got = run_extract(tmp_path, arch, txt_file)
    n_blocks = lm.n_blocks
    assert got["md"]["layers"] == list(range(n_blocks)) and got["md"]["family"] == arch
    assert got["md"]["cls_token"] is False and len(got["acts"]) == len(TEXTS)
    tok = lm.tokenizer
    norm = dict(lm.model.named_modules())[FINAL_NORM[arch]] if arch in FINAL_NORM else None
    for i, text in enumerate(TEXTS):
        ids = tok(text, truncation=True, max_length=24)["input_ids"]
        assert got["lengths"][i] == len(ids)
        with torch.inference_mode():
            hs = lm.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        for layer in range(n_blocks):
            stored = got["acts"][i, layer, : len(ids)]
            if layer == n_blocks - 1 and norm is not None:
                # causal LMs put the final norm into hidden_states[-1]; the block output is before it
                with torch.inference_mode():
                    stored_t = norm(torch.from_numpy(stored.copy()))
                np.testing.assert_allclose(stored_t.numpy(), hs[layer + 1][0].numpy(), atol=1e-5, rtol=0)
                assert not np.allclose(stored, hs[layer + 1][0].numpy(), atol=1e-3)
            else:
                np.testing.assert_allclose(stored, hs[layer + 1][0].numpy(), atol=1e-5, rtol=0)
        assert not got["acts"][i, :, len(ids):].any(), "padding must be zeros"
    assert [s["text"] for s in got["samples"]] == TEXTS
    assert got["sample_ids"].tolist() == list(range(len(TEXTS)))
    n_long = sum(len(tok(t)["input_ids"]) > 24 for t in TEXTS)
    assert n_long >= 1 and got["provenance"]["n_truncated"] == n_long


@pytest.mark.parametrize("arch,cls", [("vit", True), ("dinov2", True), ("clip-vision", True), ("siglip-vision", False)])
def test_vision_activations_equal_hidden_states(tmp_path: Path, arch: str, cls: bool) -> None:
    images = make_images(tmp_path)
    lm = model(arch)
    path, got = run_extract(tmp_path, arch, images, layers="0,-1")
    md = got["md"]
    assert md["cls_token"] is cls and md["patches_per_ex"] == 16 and md["layers"] == [0, lm.n_blocks - 1]
    assert md["family"] == {"clip-vision": "clip", "siglip-vision": "siglip"}.get(arch, arch)
    ds = open_dataset(images)
    pixels = torch.from_numpy(load_pixels(ds.images, lm.geometry))
    with torch.inference_mode():
        hs = lm.model(pixel_values=pixels, output_hidden_states=True).hidden_states
    for li, layer in enumerate(md["layers"]):
        np.testing.assert_allclose(got["acts"][:, li], hs[layer + 1].numpy(), atol=1e-5, rtol=0)
    assert [s["label"] for s in got["samples"]] == [0, 0, 0, 1, 1, 1]
    assert (got["lengths"] == 16 + cls).all()


def test_image_masks_give_majority_patch_labels(tmp_path: Path) -> None:
    images = make_images(tmp_path, n_per_class=2, masks=True)
    ds = open_dataset(images)
    assert ds.has_masks and len(ds) == 4 and all("masks" not in p.parts for p in ds.images)
    path, got = run_extract(tmp_path, "vit", images, layers="1")
    labels = got["labels"].reshape(4, 4, 4)  # [sample, patch row, patch col]
    for i, c in enumerate([1, 1, 2, 2]):
        assert (labels[i, :, :2] == c).all()  # left half
        assert labels[i, 0, 2] == 7 and labels[i, 1, 3] == 3
        assert labels[i, 2:, 2:].tolist() == [[0, 0], [0, 0]]
    reader = actlake.open(path)
    assert reader.token_labels.shape == (4, 17) and (reader.token_labels[:, 0] == 0).all()


# ------------------------------------------------------------------------------------------
# early exit, layers, padding
# ------------------------------------------------------------------------------------------


def count_blocks(lm: Any) -> tuple[list[int], list[Any]]:
    counts = [0] * lm.n_blocks
    _, blocks = find_blocks(lm.model)
    handles = [b.register_forward_pre_hook(lambda m, a, i=i: counts.__setitem__(i, counts[i] + 1))
               for i, b in enumerate(blocks)]
    return counts, handles


@pytest.mark.parametrize("arch", ["llama", "bert", "vit"])
def test_early_exit_runs_only_needed_blocks(tmp_path: Path, txt_file: Path, arch: str) -> None:
    lm = model(arch)
    data = make_images(tmp_path) if arch == "vit" else txt_file
    counts, handles = count_blocks(lm)
    try:
        cfg = ExtractConfig(model="unused", data=str(data), out=tmp_path / "a", layers="1", batch_size=4, device="cpu")
        result = extract(cfg, model=lm)
        assert result.batches > 1
        assert counts == [result.batches, result.batches, 0, 0]
        counts[:] = [0] * lm.n_blocks
        result = extract(ExtractConfig(model="unused", data=str(data), out=tmp_path / "b", layers="-1", batch_size=4,
                                       device="cpu"), model=lm)
        assert counts == [result.batches] * 4
    finally:
        for h in handles:
            h.remove()


def test_layer_parsing_and_normalisation() -> None:
    assert normalize_layers("0,-1", 6) == (0, 5)
    assert normalize_layers("all", 3) == (0, 1, 2)
    assert normalize_layers([5, 0, 3, -1], 6) == (0, 3, 5)
    assert parse_layers("0-2,5") == [0, 1, 2, 5]
    with pytest.raises(ConfigError, match="out of range"):
        normalize_layers([6], 6)
    with pytest.raises(ConfigError, match="out of range"):
        normalize_layers([-7], 6)
    with pytest.raises(ConfigError):
        parse_layers("one,two")


@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert"])
def test_left_and_right_padding_store_the_same(tmp_path: Path, txt_file: Path, arch: str) -> None:
    _, right = run_extract(tmp_path, arch, txt_file, name="right", padding_side="right")
    _, left = run_extract(tmp_path, arch, txt_file, name="left", padding_side="left")
    assert (right["lengths"] == left["lengths"]).all()
    np.testing.assert_allclose(left["acts"], right["acts"], atol=1e-5, rtol=0)


def test_pad_batch_positions() -> None:
    seqs = [np.array([5, 6, 7]), np.array([8])]
    right, left = pad_batch(seqs, 0, "right"), pad_batch(seqs, 0, "left")
    assert right.input_ids.tolist() == [[5, 6, 7], [8, 0, 0]] and left.input_ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert left.position_ids.tolist() == [[0, 1, 2], [0, 0, 0]] and left.starts.tolist() == [0, 2]
    assert right.position_ids[1, 0] == 0 and right.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=0, max_size=60), st.integers(1, 7), st.integers(1, 4))
def test_plan_windows_cover_every_position_once(lengths: list[int], batch_size: int, bucket: int) -> None:
    windows = plan_windows(np.array(lengths, dtype=np.int64), batch_size, bucket)
    seen = np.concatenate([b for w in windows for b in w.batches]) if windows else np.array([], np.int64)
    assert sorted(seen.tolist()) == list(range(len(lengths)))
    for w in windows:
        inside = np.concatenate(w.batches)
        assert sorted(inside.tolist()) == list(range(w.start, w.stop)) and w.stop - w.start <= batch_size * bucket
        assert all(len(b) <= batch_size for b in w.batches)
        got = np.array(lengths)[inside]
        assert (np.diff(got) <= 0).all()  # longest first inside a window


# ------------------------------------------------------------------------------------------
# machine slicing
# ------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 64))
def test_machine_slices_disjoint_and_complete(n: int, machines: int) -> None:
    covered = []
    for m in range(machines):
        start, stop, spm = machine_slice(n, m, machines)
        assert spm == -(-n // machines)
        local = np.arange(stop - start)
        covered.append(m * spm + local)  # the spec's global sample_idx
        assert (m * spm + local == np.arange(start, stop)).all()
    allids = np.concatenate(covered)
    assert len(allids) == n and (np.sort(allids) == np.arange(n)).all()


def test_machine_extractions_union_is_the_dataset(tmp_path: Path, txt_file: Path) -> None:
    _, whole = run_extract(tmp_path, "bert", txt_file, name="whole", layers="0,2")
    ids, acts_by_id = [], {}
    for m in range(3):
        _, part = run_extract(tmp_path, "bert", txt_file, name=f"m{m}", layers="0,2", machine_id=m, num_machines=3)
        assert part["provenance"]["machine_id"] == m and part["provenance"]["samples_per_machine"] == 4
        ids.extend(part["sample_ids"].tolist())
        for k, sid in enumerate(part["sample_ids"]):
            n = part["lengths"][k]
            acts_by_id[int(sid)] = part["acts"][k, :, :n]
    assert sorted(ids) == list(range(len(TEXTS))) and len(set(ids)) == len(ids)
    for sid in range(len(TEXTS)):
        n = whole["lengths"][sid]
        np.testing.assert_allclose(acts_by_id[sid], whole["acts"][sid, :, :n], atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------
# resume: kill -9 mid-run, rerun, byte-identical
# ------------------------------------------------------------------------------------------


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_killed_run_resumes_byte_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture) -> None:
    from actlake.cli import main

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")  # pins provenance.created_at
    args = ["--model", "tiny-random:gpt2", "--data", "builtin:stdlib-docs", "--limit", "300", "--layers", "all",
            "--max-seq-len", "48", "--batch-size", "4", "--device", "cpu", "--option", "patches_per_shard=3840",
            "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "actlake.cli", "extract", *args, "--out", str(killed)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if list(killed.glob(".tmp-*/acts000001.bin")):
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.002)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert len([p for p in killed.glob(".tmp-*") if p.is_dir()]) == 1  # (beside it: the writer's lock file)
    assert not [p for p in killed.iterdir() if not p.name.startswith(".")], "nothing published by a killed run"
    assert main(["extract", *args, "--out", str(killed)]) == 0  # rerun: same arguments
    lines = capsys.readouterr().out.strip().splitlines()
    assert "resumed after" in lines[-2]
    resumed_path = Path(lines[-1])
    assert resumed_path.parent == killed and resumed_path.is_dir() and not list(killed.glob(".tmp-*"))
    clean = tmp_path / "clean"
    assert main(["extract", *args, "--out", str(clean)]) == 0
    assert "resumed" not in capsys.readouterr().out
    clean_path = clean / resumed_path.name
    a, b = _tree_bytes(resumed_path), _tree_bytes(clean_path)
    assert a.keys() == b.keys() and len([k for k in a if k.startswith("acts")]) > 3
    assert [k for k in a if a[k] != b[k]] == []


def test_rerun_of_published_store_is_a_no_op(tmp_path: Path, txt_file: Path) -> None:
    cfg = ExtractConfig(model="tiny-random:bert", data=str(txt_file), out=tmp_path, layers="0", device="cpu")
    first = extract(cfg, model=model("bert"))
    second = extract(cfg, model=model("bert"))
    assert first.path == second.path and second.batches == 0 and second.resumed_from == len(TEXTS)


def test_second_writer_of_the_same_store_is_a_clear_error(tmp_path: Path, txt_file: Path) -> None:
    from actlake.atomic import remove_tree
    from actlake.errors import FormatError
    from actlake.formats import create_writer

    cfg = ExtractConfig(model="tiny-random:bert", data=str(txt_file), out=tmp_path, layers="0", device="cpu")
    first = extract(cfg, model=model("bert"))
    remove_tree(first.path)
    holder = create_writer("saev", tmp_path, first.spec)  # another process writing the same store right now
    try:
        with pytest.raises(FormatError) as err:
            extract(cfg, model=model("bert"))
        assert "another process" in str(err.value) and err.value.path is not None
        assert first.path.name in str(err.value.path)
    finally:
        holder.abort()
    again = extract(cfg, model=model("bert"))  # the lock is gone with its holder
    assert again.path == first.path and read_saev(again.path)["acts"].shape[0] == len(TEXTS)


# ------------------------------------------------------------------------------------------
# Batches for other writers: prompt/response, logits top-k, token perplexity
# ------------------------------------------------------------------------------------------


class MemoryWriter(Writer):
    """Collects batches (a format module registered only for this test)."""

    instances: list["MemoryWriter"] = []

    def __init__(self, out_root: Path, spec: Any) -> None:
        self.spec, self.batches, self.out = spec, [], Path(out_root)
        MemoryWriter.instances.append(self)

    def write_batch(self, batch: Batch) -> None:
        self.batches.append(batch)

    def close(self) -> Path:
        return self.out


@pytest.fixture
def memory_format(monkeypatch: pytest.MonkeyPatch) -> type[MemoryWriter]:
    module = types.ModuleType("actlake_test_memory_format")
    module.FORMAT = "memory"
    module.create_writer = MemoryWriter
    module.DEFAULT_DTYPE = "float16"
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(FORMAT_MODULES, "memory", module.__name__)
    MemoryWriter.instances.clear()
    return MemoryWriter


def test_prompt_response_logits_and_perplexity(tmp_path: Path, memory_format: type[MemoryWriter]) -> None:
    rows = [{"prompt": "What is two plus two?", "response": "Four, of course.", "label": "ok"},
            {"prompt": "Name a colour.", "response": "Blue", "label": "bad"},
            {"prompt": "Say something long please", "response": "one two three four five six seven eight nine ten eleven twelve thirteen",
             "label": "ok"}]
    f = tmp_path / "pairs.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lm = model("gpt2")
    cfg = ExtractConfig(model="x", data=str(f), out=tmp_path, layers="1,3", format="memory", batch_size=2,
                        max_seq_len=16, device="cpu", options={"logits_topk": 3}, padding_side="left")
    extract(cfg, model=lm)
    (writer,) = memory_format.instances
    assert writer.spec.dtype == "float16"  # the format's DEFAULT_DTYPE
    batch = Batch(**{k: (np.concatenate([getattr(b, k) for b in writer.batches])
                         if isinstance(getattr(writer.batches[0], k), np.ndarray) else
                         sum((list(getattr(b, k)) for b in writer.batches), []) if getattr(writer.batches[0], k) is not None
                         and k != "extra" else getattr(writer.batches[0], k))
                     for k in ("acts_bltd", "lengths", "sample_ids", "texts", "labels", "token_ids", "response_bltd",
                               "response_lengths", "response_texts", "logits_topk_values", "logits_topk_indices")})
    extra = {k: sum((list(b.extra[k]) for b in writer.batches), []) for k in writer.batches[0].extra}
    assert batch.texts == [r["prompt"] for r in rows] and batch.response_texts == [r["response"] for r in rows]
    assert batch.labels.tolist() == [1, 0, 1] and batch.acts_bltd.dtype == np.float16
    tok = lm.tokenizer
    for i, r in enumerate(rows):
        p = tok(r["prompt"])["input_ids"]
        q = tok(r["response"], add_special_tokens=False)["input_ids"][: 16 - len(p)]
        ids = p + q
        assert batch.lengths[i] == len(p) and batch.response_lengths[i] == len(q)
        assert batch.token_ids[i, : len(p)].tolist() == p
        with torch.inference_mode():
            out = lm.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        for li, layer in enumerate((1, 3)):
            full = out.hidden_states[layer + 1][0].numpy() if layer < 3 else None
            if full is not None:
                np.testing.assert_allclose(batch.acts_bltd[i, li, : len(p)], full[: len(p)], atol=2e-3)
                np.testing.assert_allclose(batch.response_bltd[i, li, : len(q)], full[len(p):], atol=2e-3)
        logits = out.logits[0].float()
        values, indices = logits[-1].topk(3)
        np.testing.assert_allclose(batch.logits_topk_values[i], values.numpy(), atol=1e-4)
        assert batch.logits_topk_indices[i].tolist() == indices.tolist()
        logp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        ppl = extra["token_perplexity"][i]
        assert len(ppl) == len(ids) - 1 and np.isfinite(ppl).all()
        np.testing.assert_allclose(ppl, torch.exp(-logp).numpy(), rtol=1e-4)
    assert extra["truncated"] == [False, False, True]


class FailingWriter(MemoryWriter):
    """Fails on its second batch the way a full disk does."""

    aborted = False

    def write_batch(self, batch: Batch) -> None:
        if self.batches:
            raise OSError(28, "No space left on device")
        super().write_batch(batch)

    def abort(self) -> None:
        FailingWriter.aborted = True


def test_writer_failure_in_the_writer_thread_is_a_clear_error(tmp_path: Path, txt_file: Path,
                                                             memory_format: type[MemoryWriter]) -> None:
    from actlake.errors import FormatError

    sys.modules["actlake_test_memory_format"].create_writer = FailingWriter
    cfg = ExtractConfig(model="x", data=str(txt_file), out=tmp_path / "store", format="memory", batch_size=2,
                        bucket_batches=1, device="cpu")
    with pytest.raises(FormatError) as err:
        extract(cfg, model=model("bert"))
    assert err.value.path == tmp_path / "store" and "memory" in str(err.value) and "No space left" in str(err.value)
    assert isinstance(err.value.__cause__, OSError) and FailingWriter.aborted


def test_logits_topk_needs_a_causal_lm(tmp_path: Path, txt_file: Path, memory_format: type[MemoryWriter]) -> None:
    with pytest.raises(ConfigError, match="causal"):
        extract(ExtractConfig(model="x", data=str(txt_file), out=tmp_path, format="memory",
                              options={"logits_topk": 2}), model=model("bert"))


# ------------------------------------------------------------------------------------------
# datasets
# ------------------------------------------------------------------------------------------


def test_txt_jsonl_parquet_and_disk_datasets(tmp_path: Path) -> None:
    import datasets as hf
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = ["first line", "", "second line", "   ", "third"]
    (tmp_path / "a.txt").write_text("\n".join(lines) + "\n")
    txt = open_dataset(tmp_path / "a.txt")
    assert txt.texts == ("first line", "second line", "third") and txt.ids == (1, 3, 5)
    assert txt.details["skipped_empty"] == 2
    (tmp_path / "ff.txt").write_bytes("page\x0cbreak stays one line\r\nsecond\n".encode())
    ff = open_dataset(tmp_path / "ff.txt", DatasetFields(text="body"))  # text fields do not apply to .txt
    assert ff.texts == ("page\x0cbreak stays one line", "second") and ff.ids == (1, 2)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" if t else "\n" for t in lines))
    jsl = open_dataset(tmp_path / "a.jsonl")
    assert jsl.texts == txt.texts and jsl.fingerprint == txt.fingerprint  # content, not file format

    recs = [{"body": "alpha", "y": "pos", "key": "k1"}, {"body": "beta", "y": "neg", "key": "k2"},
            {"body": "gamma", "y": "pos", "key": "k3"}]
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    fields = DatasetFields(text="body", label="y", id="key")
    b = open_dataset(tmp_path / "b.jsonl", fields)
    assert b.texts == ("alpha", "beta", "gamma") and b.labels.tolist() == [1, 0, 1] and b.label_names == ("neg", "pos")
    assert b.ids == ("k1", "k2", "k3")
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "b.parquet")
    p = open_dataset(tmp_path / "b.parquet", fields)
    assert p.texts == b.texts and p.labels.tolist() == b.labels.tolist() and p.fingerprint == b.fingerprint
    hf.Dataset.from_list(recs).save_to_disk(str(tmp_path / "disk"))
    d = open_dataset(tmp_path / "disk", fields)
    assert d.texts == b.texts and d.fingerprint == b.fingerprint and d.source_format == "hf-disk"
    hf.DatasetDict({"train": hf.Dataset.from_list(recs), "test": hf.Dataset.from_list(recs[:1])}).save_to_disk(
        str(tmp_path / "dd"))
    assert len(open_dataset(tmp_path / "dd", DatasetFields(text="body", split="test"))) == 1
    assert len(open_dataset(tmp_path / "dd", fields, limit=2)) == 2
    pairs = open_dataset(tmp_path / "b.jsonl", DatasetFields(prompt="body", response="key"))
    assert pairs.kind == "prompt_response" and pairs.responses == ("k1", "k2", "k3")


def test_builtin_stdlib_docs_is_deterministic_english() -> None:
    a = open_dataset("builtin:stdlib-docs", limit=60)
    b = open_dataset("builtin:stdlib-docs", limit=60)
    assert a.texts == b.texts and a.fingerprint == b.fingerprint and len(a) == 60
    assert a.details["python_version"] == __import__("platform").python_version()
    words = " ".join(a.texts).lower().split()
    assert sum(w in {"the", "a", "of", "to", "is", "and"} for w in words) > 0.05 * len(words)
    assert len(set(a.texts)) == 60 and all(len(t) >= 40 for t in a.texts)
    assert open_dataset("builtin:stdlib-docs", limit=10).texts == a.texts[:10]


def test_tokenize_records_truncation() -> None:
    tok = model("bert").tokenizer
    t = tokenize_texts(tok, ["short", "a b c d e f g h i j k l m n o p"], 8)
    assert t.lengths.tolist() == [3, 8] and t.truncated.tolist() == [False, True]
    assert t.ids(1)[-1] == tok.sep_token_id  # the tokenizer's own truncation keeps [SEP]


# ------------------------------------------------------------------------------------------
# errors and CLI
# ------------------------------------------------------------------------------------------


def test_clear_errors(tmp_path: Path, txt_file: Path) -> None:
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model(str(tmp_path / "no-such-model"))
    assert exc.value.path == tmp_path / "no-such-model" and "never downloaded" in str(exc.value)
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model(str(tmp_path / "emptydir"))
    with pytest.raises(ModelNotFoundError, match="tiny-random"):
        resolve_model("tiny-random:t5")
    with pytest.raises(DatasetError) as dexc:
        open_dataset(tmp_path / "missing.jsonl")
    assert dexc.value.path == tmp_path / "missing.jsonl"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(DatasetError, match="line 2") as dexc:
        open_dataset(bad)
    assert dexc.value.path == bad
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match="unknown dataset file type"):
        open_dataset(tmp_path / "x.csv")
    (tmp_path / "blank.txt").write_text("\n \n")
    with pytest.raises(DatasetError, match="no non-empty"):
        open_dataset(tmp_path / "blank.txt")
    (tmp_path / "nofield.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(DatasetError, match="no field 'text'"):
        open_dataset(tmp_path / "nofield.jsonl")
    with pytest.raises(DatasetError, match="unknown builtin"):
        open_dataset("builtin:nope")
    with pytest.raises(DatasetError, match="vision model"):
        extract(ExtractConfig(model="x", data=str(txt_file), out=tmp_path), model=model("vit"))
    with pytest.raises(ConfigError, match="out of range"):
        extract(ExtractConfig(model="x", data=str(txt_file), out=tmp_path, layers="9"), model=model("bert"))


def test_cli_extract_prints_published_dir_last(tmp_path: Path, txt_file: Path, capsys: pytest.CaptureFixture) -> None:
    from actlake.cli import main

    rc = main(["extract", "--model", "tiny-random:bert", "--data", str(txt_file), "--layers", "0,3", "--format",
               "saev", "--out", str(tmp_path), "--batch-size", "4", "--device", "cpu", "--option",
               "patches_per_shard=500"])
    out = capsys.readouterr()
    assert rc == 0 and "tok" in out.err  # the progress bar counts tokens
    last = Path(out.out.strip().splitlines()[-1])
    assert last.parent == tmp_path and json.loads((last / "metadata.json").read_text())["patches_per_shard"] == 500
    rc = main(["extract", "--model", str(tmp_path / "nope"), "--data", str(txt_file), "--out", str(tmp_path)])
    assert rc == 2 and "nope" in capsys.readouterr().err

