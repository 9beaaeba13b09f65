"""Greedy responses from a causal LM, generated before extraction so prompt and response are stored apart.

The generated text becomes the response of a prompt/response dataset; extraction then runs one
teacher-forced forward pass over prompt + response (re-tokenised from the text), exactly as for
responses given in the data. Only this machine's slice is generated.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from typing import Any

from ..errors import ConfigError
from .datasets import Dataset
from .models import LoadedModel


def generate_responses(loaded: LoadedModel, ds: Dataset, *, max_new_tokens: int, start: int, stop: int,
                       batch_size: int, max_seq_len: int, progress: bool = False) -> Dataset:
    """`ds` as a prompt/response dataset whose responses for positions [start, stop) are greedy generations."""
    import torch
    from tqdm import tqdm

    if not loaded.causal_lm:
        raise ConfigError(f"generating responses needs a causal language model; {loaded.name} is {loaded.model_type}")
    if ds.kind != "text" or ds.texts is None:
        raise ConfigError(f"generating responses needs a text dataset of prompts, got a {ds.kind} dataset")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    tok = loaded.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if pad_id is None:
        raise ConfigError(f"the tokenizer of {loaded.name} has neither a pad nor an eos token")
    eos = loaded.model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tok.eos_token_id is not None:
        eos_ids.add(tok.eos_token_id)
    responses = [""] * len(ds)
    side = tok.padding_side
    tok.padding_side = "left"  # generation continues from the last real token of every row
    try:
        with torch.inference_mode():
            for a in tqdm(range(start, stop, batch_size), disable=not progress, file=sys.stderr, desc="generate",
                          unit="batch"):
                prompts = list(ds.texts[a : min(a + batch_size, stop)])
                enc = tok(prompts, return_tensors="pt", padding=True, truncation=True, max_length=max_seq_len)
                enc = {k: v.to(loaded.device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
                out = loaded.model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                            pad_token_id=pad_id)
                new = out[:, enc["input_ids"].shape[1]:].cpu().tolist()
                for j, ids in enumerate(new):
                    responses[a + j] = tok.decode(_generated_ids(ids, eos_ids, pad_id), skip_special_tokens=False,
                                                  clean_up_tokenization_spaces=False)
    finally:
        tok.padding_side = side
    generation: dict[str, Any] = {"max_new_tokens": max_new_tokens, "decoding": "greedy", "model": loaded.name,
                                  "weights_sha256": loaded.weights_sha256}  # no slice: one identity per run
    fingerprint = hashlib.sha256(
        json.dumps({"prompts": ds.fingerprint, "generation": generation}, sort_keys=True).encode("utf-8")
    ).hexdigest()
    return dataclasses.replace(ds, kind="prompt_response", responses=tuple(responses), fingerprint=fingerprint,
                               details={**ds.details, "generation": generation})


def _generated_ids(ids: list[int], eos_ids: set[int], pad_id: int) -> list[int]:
    """The tokens really generated: up to and including the first end-of-sequence, no trailing padding.

    Special tokens are kept (the response text then re-tokenises to the tokens whose activations
    are stored, an end-of-sequence token included).
    """
    for i, t in enumerate(ids):
        if t in eos_ids:
            return ids[: i + 1]
    while ids and ids[-1] == pad_id:
        ids = ids[:-1]
    return ids
