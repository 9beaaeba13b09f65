"""`--generate-max-new-tokens`: greedy responses generated first, then prompt/response stored apart (Zarr)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from actlake.errors import ConfigError
from actlake.extract import ExtractConfig, extract, load_model

PROMPTS = ["the cat sat on", "hello world this is a", "a third prompt"]


def test_generated_responses_are_stored_with_their_activations(tmp_path: Path) -> None:
    data = tmp_path / "prompts.txt"
    data.write_text("\n".join(PROMPTS) + "\n")
    lm = load_model("tiny-random:gpt2", device="cpu")
    cfg = ExtractConfig(model="tiny-random:gpt2", data=str(data), out=tmp_path / "out", format="zarr",
                        generate_max_new_tokens=4, batch_size=2, max_seq_len=32, device="cpu")
    result = extract(cfg, model=lm)
    store = result.path / "activations.zarr"
    group = zarr.open_group(str(store), mode="r")
    responses = [json.loads(x)["response"] for x in (store / "text" / "responses.jsonl").read_text().splitlines()]
    tok = lm.tokenizer
    for i, prompt in enumerate(PROMPTS):
        # independent greedy generation with the same model
        enc = tok([prompt], return_tensors="pt")
        with torch.inference_mode():
            out = lm.model.generate(**{k: enc[k] for k in ("input_ids", "attention_mask")}, max_new_tokens=4,
                                    do_sample=False, pad_token_id=tok.pad_token_id)
        new_ids = out[0, enc["input_ids"].shape[1]:].tolist()
        assert responses[i] == tok.decode(new_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        # teacher-forced activations of prompt + response, split at the prompt length
        p_ids = tok(prompt)["input_ids"]
        r_ids = tok(responses[i], add_special_tokens=False)["input_ids"]
        assert len(r_ids) == 4
        with torch.inference_mode():
            hidden = lm.model(torch.tensor([p_ids + r_ids]), output_hidden_states=True).hidden_states
        p_len, r_len = int(group["arrays/prompt_len"][i]), int(group["arrays/response_len"][i])
        assert (p_len, r_len) == (len(p_ids), len(r_ids))
        for li in range(3):  # the last block's output is before the final norm (docs/formats/extraction.md)
            want = hidden[li + 1][0].numpy()
            got_p = group["arrays/prompt_activations"][i, li, :p_len]
            got_r = group["arrays/response_activations"][i, li, :r_len]
            np.testing.assert_allclose(got_p.astype(np.float32), want[:p_len], rtol=2e-3, atol=2e-3)
            np.testing.assert_allclose(got_r.astype(np.float32), want[p_len:], rtol=2e-3, atol=2e-3)
    provenance = json.loads(json.dumps(result.spec.data))
    assert provenance["dataset"]["generation"]["max_new_tokens"] == 4


def test_generation_needs_a_causal_lm(tmp_path: Path) -> None:
    data = tmp_path / "prompts.txt"
    data.write_text("one\ntwo\n")
    cfg = ExtractConfig(model="tiny-random:bert", data=str(data), out=tmp_path / "out", format="zarr",
                        generate_max_new_tokens=2, device="cpu")
    with pytest.raises(ConfigError, match="causal language model"):
        extract(cfg)
    with pytest.raises(ConfigError):
        ExtractConfig(model="tiny-random:gpt2", data=str(data), out=tmp_path, generate_max_new_tokens=0)
