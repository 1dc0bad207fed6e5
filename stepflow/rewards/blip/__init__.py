"""A minimal BLIP (Li et al. 2022) port for ImageReward: the ViT image encoder and the BERT text encoder with
cross-attention ("med"), written for stepflow on plain ``torch.nn`` (no timm, fairscale, or transformers
``PreTrainedModel`` machinery, so it runs on transformers 5).

Only the inference path ImageReward uses is implemented; module and parameter names mirror the original BLIP code
(BSD-3-Clause, salesforce/BLIP; ImageReward is Apache-2.0, THUDM/ImageReward) so that the official
``ImageReward.pt`` state dict loads unchanged.
"""

from stepflow.rewards.blip.med import MedConfig, MedTextEncoder
from stepflow.rewards.blip.vit import VisionTransformer

__all__ = ["MedConfig", "MedTextEncoder", "VisionTransformer"]
