"""A tiny random CLIP (byte-level BPE tokenizer, 2-layer towers) built locally, for tests, smoke runs and benchmarks
of the CLIP-based rewards on a machine without their weights: ``reward=pickscore_tiny``.

The model and processor are written with ``save_pretrained`` into ``$STEPFLOW_CACHE`` (default ~/.cache/stepflow)
once and loaded back through the rewards' own loading code, as PickScore_v1 would be. It scores nothing meaningful.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from stepflow.testing.tiny_policies import bytes_to_unicode, keeps_rng

__all__ = ["clip_tokenizer", "tiny_clip_config", "build_tiny_clip", "tiny_clip_dir", "tiny_pickscore"]


def clip_tokenizer():
    """A tiny but complete byte-level CLIP BPE tokenizer (516 tokens, two merges): any text tokenizes."""
    from transformers import CLIPTokenizer

    v = list(bytes_to_unicode().values())
    merges = [("a", "t</w>"), ("c", "at</w>")]
    v = v + [x + "</w>" for x in v] + ["at</w>", "cat</w>", "<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(v)}, merges=merges, model_max_length=77)


def tiny_clip_config(tokenizer, image_size: int = 32, patch_size: int = 8, num_layers: int = 2, **kwargs):
    """A tiny ``CLIPConfig`` for ``tokenizer`` (:func:`clip_tokenizer`: its vocabulary size and special tokens): both
    towers 32 wide, 4 heads, ``num_layers`` deep, a ViT of ``image_size`` px in ``patch_size`` patches, projection
    width 768 (ViT-L/14's, which the aesthetic head expects); ``kwargs`` go to ``CLIPConfig``."""
    from transformers import CLIPConfig

    return CLIPConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                         num_attention_heads=4, max_position_embeddings=77, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers, num_attention_heads=4,
                           image_size=image_size, patch_size=patch_size, projection_dim=768),
        projection_dim=768, **kwargs)


@keeps_rng
def build_tiny_clip(directory: str | os.PathLike, seed: int = 0) -> Path:
    """Write a random tiny ``CLIPModel`` (projection width 768, ViT-L/14's, which the aesthetic head expects) and its
    ``CLIPProcessor`` (32 px) to ``directory``."""
    import torch
    from transformers import CLIPImageProcessor, CLIPModel, CLIPProcessor

    torch.manual_seed(seed)
    tok = clip_tokenizer()
    cfg = tiny_clip_config(tok, logit_scale_init_value=math.log(57.0))
    proc = CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32},
                                                            crop_size={"height": 32, "width": 32}), tokenizer=tok)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    CLIPModel(cfg).eval().save_pretrained(d)
    proc.save_pretrained(d)
    return d


def tiny_clip_dir(seed: int = 0, cache_dir: str | os.PathLike | None = None) -> Path:
    """The cached tiny CLIP folder (built on first use)."""
    root = Path(cache_dir or os.environ.get("STEPFLOW_CACHE") or Path.home() / ".cache" / "stepflow")
    d = root / f"tiny_clip-v1-s{seed}"
    if not (d / "config.json").is_file():
        build_tiny_clip(d, seed)
    return d


def tiny_pickscore(seed: int = 0, **kwargs):
    """``reward=pickscore_tiny``: PickScore's formula on the tiny CLIP, loaded through ``PickScore``'s own code."""
    from stepflow.rewards.clip_based import PickScore

    d = str(tiny_clip_dir(seed))
    return PickScore(model_path=d, processor_path=d, **kwargs)
