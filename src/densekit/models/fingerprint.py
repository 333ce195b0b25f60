"""A loaded model's fingerprint: its weights and tokenizer, whatever folder or format they came from."""

from __future__ import annotations

import functools
import hashlib
import json

import torch
from transformers import PreTrainedTokenizerBase


def weights_fingerprint(modules: list[torch.nn.Module], tokenizer: PreTrainedTokenizerBase | None) -> str:
    """SHA-256 over every tensor (name, dtype, shape, bytes) of `modules` and the tokenizer's
    vocabulary and rules: equal for the same weights saved anywhere, different after any change."""
    digest = hashlib.sha256()
    seen: set[int] = set()
    for module in modules:
        if id(module) in seen:
            continue
        seen.add(id(module))
        _add_tensors(digest, module.state_dict())
    if tokenizer is not None:
        digest.update(_tokenizer_rules(tokenizer).encode())
        digest.update(f"|{tokenizer.padding_side}|{tokenizer.pad_token_id}".encode())
    return f"sha256:{digest.hexdigest()}"


def tensors_fingerprint(tensors: dict[str, torch.Tensor], settings: str) -> str:
    """SHA-256 over named tensors (name, dtype, shape, bytes) and a settings text."""
    digest = hashlib.sha256(settings.encode())
    _add_tensors(digest, tensors)
    return f"sha256:{digest.hexdigest()}"


def _add_tensors(digest: hashlib._Hash, tensors: dict[str, torch.Tensor]) -> None:
    for name, tensor in tensors.items():
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}|{flat.dtype}|{tuple(tensor.shape)}\n".encode())
        digest.update(flat.view(torch.uint8).numpy() if flat.numel() else b"")


def _tokenizer_rules(tokenizer: PreTrainedTokenizerBase) -> str:
    """The tokenizer's vocabulary and rules, without the truncation and padding state that each call
    to it sets."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return json.dumps(sorted(tokenizer.get_vocab().items()))
    return _rules_of(backend.to_str())


@functools.lru_cache(maxsize=8)
def _rules_of(serialised: str) -> str:
    """A fast tokenizer's serialised form without its truncation and padding state, keys sorted.
    Cached: every artefact identity asks for the same tokenizer's rules again, and sorting the keys of
    a 30,000-word vocabulary takes three times as long as serialising it."""
    rules = json.loads(serialised)
    rules.pop("truncation", None)
    rules.pop("padding", None)
    return json.dumps(rules, sort_keys=True)
