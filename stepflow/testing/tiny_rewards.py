"""A tiny random CLIP (byte-level BPE tokenizer, 2-layer towers) built locally, for tests, smoke runs and benchmarks
of the CLIP-based rewards on a machine without their weights: ``reward=pickscore_tiny``.

The model and processor are written with ``save_pretrained`` into ``$STEPFLOW_CACHE`` (default ~/.cache/stepflow)
once and loaded back through the rewards' own loading code, as PickScore_v1 would be. It scores nothing meaningful.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from stepflow.testing.tiny_policies import keeps_rng

__all__ = ["clip_tokenizer", "build_tiny_clip", "tiny_clip_dir", "tiny_pickscore"]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP byte-level alphabet (printable bytes map to themselves, the rest to code points >= 256)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def clip_tokenizer():
    """A tiny but complete byte-level CLIP BPE tokenizer (516 tokens, two merges): any text tokenizes."""
    from transformers import CLIPTokenizer

    v = list(_bytes_to_unicode().values())
    merges = [("a", "t</w>"), ("c", "at</w>")]
    v = v + [x + "</w>" for x in v] + ["at</w>", "cat</w>", "<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(v)}, merges=merges, model_max_length=77)


@keeps_rng
def build_tiny_clip(directory: str | os.PathLike, seed: int = 0) -> Path:
    """Write a random tiny ``CLIPModel`` (projection width 768, ViT-L/14's, which the aesthetic head expects) and its
    ``CLIPProcessor`` (32 px) to ``directory``."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    torch.manual_seed(seed)
    tok = clip_tokenizer()
    cfg = CLIPConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=77, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8, projection_dim=768),
        projection_dim=768,
        logit_scale_init_value=math.log(57.0),
    )
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
