"""Training data: sources, tokenizers, packing and the grain pipeline.

Start with :func:`make_pipeline` and :class:`DataConfig`; the batch contract is
described in :mod:`maxnnx.data.pipeline`.
"""

from maxnnx.data.config import DataConfig
from maxnnx.data.pipeline import Pipeline, make_pipeline
from maxnnx.data.sources import resolve_source
from maxnnx.data.text import DEFAULT_CORPUS, TokenWindows, train_sentencepiece
from maxnnx.data.tokenizer import (
    HFTokenizer,
    SentencePieceTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    load_tokenizer,
)

__all__ = [
    'DEFAULT_CORPUS', 'DataConfig', 'HFTokenizer', 'Pipeline', 'SentencePieceTokenizer',
    'TiktokenTokenizer', 'TokenWindows', 'Tokenizer', 'load_tokenizer',
    'make_pipeline', 'resolve_source', 'train_sentencepiece',
]
