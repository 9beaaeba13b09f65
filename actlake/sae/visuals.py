"""Visuals of an inference dump: per-latent HTML pages (text) or PNG heat-map grids (images), a summary PNG, an index.

Written to `inference/<shard_hash>/visuals/`. Token strings for text come from the tokenizer of
the model the shards were extracted with when it is on local disk (re-tokenising the stored
text and keeping the result only when its length equals the stored token count); otherwise
from word pieces of the stored text aligned by token index (approximate; the index page says
which). See docs/formats/runs.md.
"""

from __future__ import annotations

import html
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import scipy.sparse as sp

from ..atomic import remove_tree, replace_dir
from ..errors import ConfigError, MetadataError, RunError
from ..jsonio import read_json
from ..reader import Reader
from ..run_guard import check_links
from .infer import load_patch_acts

if TYPE_CHECKING:
    from ..runs import Run

TOKENIZER_KEYS = ("tokenizer", "tokenizer_path", "checkpoint_path", "model_path", "model_dir", "model_source", "ckpt", "model_name", "model")
WORD_RE = re.compile(r"\w+|[^\w\s]", re.UNICODE)


@dataclass(frozen=True)
class VisualsConfig:
    """How many latents and examples to draw, and how much context around each token."""

    top_latents: int = 32
    contexts: int = 16
    window: int = 12
    latents: tuple[int, ...] | None = None  # explicit latents instead of the ranking

    def __post_init__(self) -> None:
        if self.top_latents < 1 or self.contexts < 1 or self.window < 0:
            raise ConfigError("top_latents and contexts must be >= 1, window >= 0")
        if self.latents is not None:
            object.__setattr__(self, "latents", tuple(int(x) for x in self.latents))


# ---- latent statistics -------------------------------------------------------------------

def latent_stats(acts: sp.csr_matrix) -> dict[str, np.ndarray]:
    """Per-latent firing counts, activation sums and maxima (columns of the dump)."""
    csc = acts.tocsc()
    counts = np.diff(csc.indptr)
    sums = np.asarray(csc.sum(axis=0)).ravel()
    maxima = np.zeros(acts.shape[1], dtype=np.float64)
    nz = counts > 0
    if nz.any():
        maxima[nz] = np.maximum.reduceat(csc.data, csc.indptr[:-1][nz])
    return {"counts": counts, "sums": sums, "max": maxima}


def rank_latents(stats: dict[str, np.ndarray], n: int) -> list[int]:
    """The `n` latents with the largest total activation (ties: lower index first)."""
    sums = stats["sums"]
    order = np.lexsort((np.arange(len(sums)), -sums))
    return [int(j) for j in order[:n] if sums[j] > 0]


def top_examples(column: sp.csc_matrix | sp.csr_matrix, latent: int, tokens_per_example: int,
                 n: int) -> list[tuple[int, int, float]]:
    """(sample, token, value) of the `n` samples where `latent` peaks highest (one per sample)."""
    col = column[:, [latent]].tocoo()
    rows, vals = col.row.astype(np.int64), col.data
    if not len(rows):
        return []
    samples = rows // tokens_per_example
    order = np.lexsort((rows, -vals))  # by value desc, then row asc
    seen: set[int] = set()
    out: list[tuple[int, int, float]] = []
    for i in order:
        s = int(samples[i])
        if s in seen:
            continue
        seen.add(s)
        out.append((s, int(rows[i] % tokens_per_example), float(vals[i])))
        if len(out) == n:
            break
    return out


# ---- token strings -----------------------------------------------------------------------

def _tokenizer_sources(reader: Reader) -> list[str]:
    """Where the shards' tokenizer may be: local model dirs named by metadata or provenance first, then hub ids."""
    prov = reader.provenance
    md = getattr(reader, "metadata", None)
    values = [prov.get(k) for k in TOKENIZER_KEYS] + [getattr(md, "ckpt", None)]
    names = [v for v in dict.fromkeys(values) if isinstance(v, str) and v]
    local = [v for v in names if os.path.isdir(v) and any(
        (Path(v) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"))]
    hub = [v for v in names if not os.path.exists(v) and re.fullmatch(r"[\w.-]+/[\w.-]+", v)]
    return local + hub


def _word_pieces(text: str, n: int, offset: int) -> list[str]:
    """Approximate tokens: word/punctuation pieces of `text` placed from index `offset`, padded with '·'."""
    pieces = WORD_RE.findall(text)
    out = ["[CLS]"] * offset + pieces
    out = out[:n]
    return out + ["·"] * (n - len(out))


class TokenStrings:
    """Token strings of stored text samples, from a local tokenizer or from word pieces."""

    def __init__(self, reader: Reader) -> None:
        self.reader = reader
        self.texts = reader.texts
        self.lengths = reader.lengths
        self.tokenizer: Any = None
        self.method = ("word pieces of the stored text aligned by token index (approximate)"
                       if self.texts is not None else "token positions (the store holds no text)")
        for source in _tokenizer_sources(reader) if self.texts is not None else []:
            try:  # local files only: a hub id works only when it is already in the local cache
                from transformers import AutoTokenizer

                self.tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
                self.method = f"tokenizer from {source} (re-tokenised stored text)"
                break
            except Exception:  # noqa: BLE001 - any tokenizer failure falls back to word pieces
                self.tokenizer = None
        self.fallbacks = 0

    def tokens(self, sample: int) -> list[str]:
        """One display string per real token of `sample`."""
        n = int(self.lengths[sample])
        if self.texts is None:
            return [f"<{t}>" for t in range(n)]
        text = self.texts[sample]
        if self.tokenizer is not None:
            for special in (True, False):
                ids = self.tokenizer(text, add_special_tokens=special, truncation=True,
                                     max_length=self.reader.max_tokens)["input_ids"]
                if len(ids) == n:
                    return [_display(t) for t in self.tokenizer.convert_ids_to_tokens(ids)]
            self.fallbacks += 1
        md = getattr(self.reader, "metadata", None)
        offset = 1 if getattr(md, "cls_token", False) else 0
        return _word_pieces(text, n, offset)


def _display(token: str) -> str:
    """A tokenizer piece as shown: WordPiece '##' glue and BPE/SentencePiece space markers made visible."""
    if token.startswith("##"):
        return token[2:]
    return token.replace("\u0120", " ").replace("\u2581", " ").replace("\u010a", "\\n")


# ---- HTML --------------------------------------------------------------------------------

_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;max-width:70em}
table{border-collapse:collapse}td,th{padding:2px 8px;border-bottom:1px solid #ddd;text-align:left}
.ctx{font-family:ui-monospace,monospace;line-height:1.9;margin:.3em 0;padding:.3em;border-left:3px solid #ccc}
.tok{padding:1px 2px;border-radius:3px}
mark.act{background:rgba(255,120,0,var(--a));color:inherit;padding:1px 2px;border-radius:3px}
mark.peak{outline:2px solid #c00}
.meta{color:#666;font-size:.85em}
"""


def _page(title: str, body: str) -> str:
    return (f"<!doctype html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head><body>\n{body}\n</body></html>\n")


def _context_html(tokens: Sequence[str], acts_t: np.ndarray, peak: int, window: int, vmax: float) -> str:
    """One context: tokens around `peak`; tokens where the latent fires are <mark class='act'>, opacity = value/vmax."""
    lo, hi = max(0, peak - window), min(len(tokens), peak + window + 1)
    parts = ["… " if lo > 0 else ""]
    for t in range(lo, hi):
        tok = html.escape(tokens[t]) or "&nbsp;"
        v = float(acts_t[t])
        if v > 0:
            a = min(1.0, max(0.15, v / vmax)) if vmax > 0 else 1.0
            cls = "act peak" if t == peak else "act"
            parts.append(f"<mark class='{cls}' style='--a:{a:.2f}' title='{v:.3g}'>{tok}</mark>")
        else:
            parts.append(f"<span class='tok'>{tok}</span>")
    if hi < len(tokens):
        parts.append(" …")
    return "<div class='ctx'>" + " ".join(parts) + "</div>"


def text_latent_page(latent: int, examples: list[tuple[int, int, float]], csc: sp.csc_matrix,
                     strings: TokenStrings, tokens_per_example: int, stats: dict[str, np.ndarray],
                     n_tokens: int, window: int, sample_ids: np.ndarray) -> str:
    """HTML page of one latent: its top-activating contexts with the activating tokens highlighted."""
    vmax = float(stats["max"][latent]) or 1.0
    col = csc[:, [latent]].tocoo()
    rows, vals = col.row.astype(np.int64), col.data
    blocks = []
    for rank, (s, t, v) in enumerate(examples):
        n = int(strings.lengths[s])
        acts_t = np.zeros(n, dtype=np.float64)
        sel = (rows >= s * tokens_per_example) & (rows < s * tokens_per_example + n)
        acts_t[rows[sel] - s * tokens_per_example] = vals[sel]
        tokens = strings.tokens(s)
        blocks.append(f"<p class='meta'>#{rank + 1} · sample {s} (id {int(sample_ids[s])}) · token {t} · "
                      f"activation {v:.4g}</p>" + _context_html(tokens, acts_t, t, window, vmax))
    freq = stats["counts"][latent] / max(n_tokens, 1)
    head = (f"<p><a href='index.html'>index</a></p><h1>Latent {latent}</h1>"
            f"<p>fires on {int(stats['counts'][latent])} tokens ({freq:.3%}); max activation {vmax:.4g}; "
            f"token strings: {html.escape(strings.method)}</p>")
    return _page(f"latent {latent}", head + "\n".join(blocks))


# ---- images ------------------------------------------------------------------------------

def image_files(root: Path, reader: Reader) -> list[Path]:
    """The dataset's images numbered as the extraction numbered them (its mask tree left out)."""
    from ..extract.datasets import list_images

    described = reader.provenance.get("dataset")
    masks = described.get("masks") if isinstance(described, dict) else None
    return list_images(root, Path(masks) if masks else None)


def image_latent_grid(latent: int, examples: list[tuple[int, int, float]], csc: sp.csc_matrix, images: list[Path],
                      sample_ids: np.ndarray, tokens_per_example: int, patch_offset: int, vmax: float,
                      out: Path, size: int = 160, cols: int = 4) -> bool:
    """PNG grid of the latent's top images with a red patch heat map; False when no image could be drawn."""
    from PIL import Image

    n_patches = tokens_per_example - patch_offset
    side = int(round(n_patches ** 0.5))
    if side * side != n_patches or not examples:
        return False
    col = csc[:, [latent]].tocoo()
    rows, vals = col.row.astype(np.int64), col.data
    tiles = []
    for s, _t, _v in examples:
        idx = int(sample_ids[s])
        if not 0 <= idx < len(images):
            continue
        try:
            with Image.open(images[idx]) as im:
                img = im.convert("RGB").resize((size, size))
        except OSError:
            continue
        heat = np.zeros(n_patches, dtype=np.float64)
        base = s * tokens_per_example + patch_offset
        sel = (rows >= base) & (rows < base + n_patches)
        heat[rows[sel] - base] = vals[sel]
        heat_img = Image.fromarray((np.clip(heat / (vmax or 1.0), 0, 1).reshape(side, side) * 255).astype(np.uint8))
        alpha = heat_img.resize((size, size), Image.NEAREST)
        red = Image.new("RGB", (size, size), (255, 0, 0))
        mask = alpha.point(lambda a: int(a * 0.6))
        tiles.append(Image.composite(red, img, mask))
    if not tiles:
        return False
    n_rows = -(-len(tiles) // cols)
    grid = Image.new("RGB", (cols * size, n_rows * size), (255, 255, 255))
    for i, tile in enumerate(tiles):
        grid.paste(tile, ((i % cols) * size, (i // cols) * size))
    grid.save(out, format="PNG")
    return True


# ---- summary -----------------------------------------------------------------------------

def summary_png(out: Path, counts: np.ndarray, n_tokens: int, loss_curve: list[dict[str, Any]], title: str) -> None:
    """Two panels: histogram of log10 latent frequency (dead latents counted in the title), training loss curve."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    freq = counts / max(n_tokens, 1)
    alive = freq[freq > 0]
    if len(alive):
        ax1.hist(np.log10(alive), bins=50, color="#3a7")
    ax1.set_xlabel("log10(fraction of tokens a latent fires on)")
    ax1.set_ylabel("latents")
    ax1.set_title(f"latent frequency ({int((freq == 0).sum())} of {len(freq)} dead)")
    if loss_curve:
        tokens = [p["tokens"] for p in loss_curve]
        ax2.plot(tokens, [p["loss"] for p in loss_curve], label="loss", lw=1)
        ax2.plot(tokens, [p["mse"] for p in loss_curve], label="mse (normalised)", lw=1)
        ax2.set_yscale("log")
        ax2.legend()
    ax2.set_xlabel("training tokens")
    ax2.set_title("training loss")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, format="png", dpi=100)
    plt.close(fig)


# ---- the run-level entry point -----------------------------------------------------------

def pick_shard_hash(run: "Run", shard_hash: str | None) -> str:
    """The dump to draw: the one asked for, the only one, or the val/train shards' one."""
    from ..runs import shard_hash_of

    have = run.inference_hashes()
    if shard_hash is not None:
        if shard_hash not in have:
            raise RunError(f"no inference dump for shards {shard_hash}; have {have} (run `actlake infer` first)",
                           run.inference_root)
        return shard_hash
    if not have:
        raise RunError("run has no inference dump (run `actlake infer --run` first)", run.inference_root)
    if len(have) == 1:
        return have[0]
    for path in (run.val_shards, run.train_shards):
        if path is not None and shard_hash_of(path) in have:
            return shard_hash_of(path)
    raise RunError(f"several inference dumps {have}: choose one with --shards-hash", run.inference_root)


def _shards_of_dump(run: "Run", shard_hash: str, config: dict[str, Any]) -> Path:
    """The activation directory of a dump: a linked one with that hash, else the path recorded by infer."""
    linked = run.shards_for(shard_hash)
    if linked is not None:
        return linked
    recorded = Path(str(config.get("shards", "")))
    if not recorded.is_dir():
        raise RunError(f"shards {recorded} recorded by the inference dump no longer exist",
                       run.inference_dir(shard_hash) / "config.json")
    return recorded


def visuals_run(run: "Run", shard_hash: str | None = None, cfg: VisualsConfig | None = None, *,
                progress: bool = True) -> Path:
    """Draw `inference/<shard_hash>/visuals/` (replacing an older one) and return its path."""
    import sys

    import actlake
    from tqdm.auto import tqdm

    cfg = cfg or VisualsConfig()
    run_cfg = run.read_config()
    check_links(run, run_cfg)
    shard_hash = pick_shard_hash(run, shard_hash)
    inf = run.inference_dir(shard_hash)
    inf_cfg = read_json(inf / "config.json")
    metrics = read_json(inf / "metrics.json")
    t = inf_cfg.get("tokens_per_example") if isinstance(inf_cfg, dict) else None
    if not isinstance(t, int) or isinstance(t, bool) or t < 1 or not isinstance(metrics, dict):
        raise MetadataError("not an actlake inference config (tokens_per_example must be a positive integer)",
                            inf / "config.json")
    acts = load_patch_acts(inf)
    if acts.shape[0] % t:
        raise RunError(f"patch_acts.npz has {acts.shape[0]} rows, not a multiple of {t}", inf / "patch_acts.npz")
    stats = latent_stats(acts)
    n_tokens = int(metrics.get("n_tokens", acts.shape[0]))
    latents = list(cfg.latents) if cfg.latents is not None else rank_latents(stats, cfg.top_latents)
    for j in latents:
        if not 0 <= j < acts.shape[1]:
            raise ConfigError(f"latent {j} out of range [0, {acts.shape[1]})")
    csc = acts.tocsc()
    shards = _shards_of_dump(run, shard_hash, inf_cfg)
    tmp = inf / f".visuals-tmp-{os.getpid()}"
    remove_tree(tmp)
    tmp.mkdir()
    entries: list[str] = []
    with actlake.open(shards) as reader:
        sample_ids = reader.sample_ids
        dataset = run.dataset_for(shard_hash)
        images = image_files(dataset, reader) if dataset is not None and dataset.is_dir() else []
        md = getattr(reader, "metadata", None)
        patch_offset = 1 if getattr(md, "cls_token", False) else 0
        mode = "image" if images else "text"
        strings = TokenStrings(reader) if mode == "text" else None
        for j in tqdm(latents, desc="visuals", file=sys.stderr, disable=not progress, dynamic_ncols=True):
            examples = top_examples(csc, j, t, cfg.contexts)
            freq = stats["counts"][j] / max(n_tokens, 1)
            label = f"latent {j}</a> · freq {freq:.3%} · max {stats['max'][j]:.3g}"
            if mode == "image":
                name = f"latent_{j:06d}.png"
                if image_latent_grid(j, examples, csc, images, sample_ids, t, patch_offset,
                                     float(stats["max"][j]), tmp / name):
                    entries.append(f"<li><a href='{name}'>{label}<br><img src='{name}' width='320'></li>")
                continue
            assert strings is not None
            name = f"latent_{j:06d}.html"
            (tmp / name).write_text(text_latent_page(j, examples, csc, strings, t, stats, n_tokens, cfg.window,
                                                     sample_ids), encoding="utf-8")
            entries.append(f"<li><a href='{name}'>{label}</li>")
        token_method = strings.method if strings is not None else "n/a (images)"
    title = f"run {run.run_id} · shards {shard_hash[:16]} · layer {inf_cfg.get('layer')}"
    summary_png(tmp / "summary.png", stats["counts"], n_tokens, run_cfg.get("loss_curve", []), title)
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>"
                   for k, v in metrics.items())
    body = (f"<h1>{html.escape(title)}</h1><img src='summary.png' width='880'>"
            f"<h2>metrics</h2><table>{rows}</table>"
            f"<p class='meta'>mode: {mode}; latents ranked by total activation; "
            f"token strings: {html.escape(token_method)}; dataset: {html.escape(str(dataset))}</p>"
            f"<h2>top latents</h2><ol>{''.join(entries)}</ol>")
    (tmp / "index.html").write_text(_page(title, body), encoding="utf-8")
    return replace_dir(tmp, inf / "visuals")
