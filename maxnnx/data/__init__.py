"""Training data: the shipped corpus, tokenizers and batch sampling."""

from maxnnx.data.text import (
                              DEFAULT_CORPUS,
                              SentencePieceTokenizer,
                              TokenWindows,
                              train_sentencepiece,
)

__all__ = ['DEFAULT_CORPUS', 'SentencePieceTokenizer', 'TokenWindows', 'train_sentencepiece']
