"""Model families: one shared :class:`Transformer`, one small module per family.

Each family module declares its differences from Llama, its Hugging Face mapping and
its presets in a ``SPEC`` (:mod:`maxnnx.models.registry`), found without a list.
"""

from maxnnx.models.counting import num_active_params, num_params, num_vision_params
from maxnnx.models.pretrained import (
                                      FAMILIES,
                                      config_from_pretrained,
                                      from_pretrained,
                                      save_pretrained,
)
from maxnnx.models.registry import image_inputs_for
from maxnnx.models.transformer import Transformer

__all__ = ['FAMILIES', 'Transformer', 'config_from_pretrained', 'from_pretrained',
           'image_inputs_for', 'num_active_params', 'num_params', 'num_vision_params',
           'save_pretrained']
