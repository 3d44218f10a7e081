"""Shared flax.nnx layers. No layer knows which model family uses it."""

from maxnnx.kernels.masks import AttentionMask
from maxnnx.layers.attention import Attention
from maxnnx.layers.block import DecoderBlock
from maxnnx.layers.embedding import Embed
from maxnnx.layers.gated_deltanet import GatedDeltaNet
from maxnnx.layers.layer_call import LayerCall
from maxnnx.layers.linear import DenseGeneral
from maxnnx.layers.mlp import MLP
from maxnnx.layers.norms import LayerNorm, RMSNorm
from maxnnx.layers.params import logical_param
from maxnnx.layers.parts import BlockParts, PartFactory
from maxnnx.layers.rope import RotaryEmbedding

__all__ = ['Attention', 'AttentionMask', 'BlockParts', 'DecoderBlock', 'DenseGeneral', 'Embed',
           'GatedDeltaNet', 'LayerCall', 'LayerNorm', 'MLP', 'PartFactory', 'RMSNorm',
           'RotaryEmbedding', 'logical_param']
