"""Training data: sources, tokenizers, packing and the grain pipeline.

Start with :func:`make_pipeline` and :class:`DataConfig`; the batch contract is
described in :mod:`maxnnx.data.pipeline`, and what a Trainer asks of a source
(:class:`DataSource` and its optional capabilities) in :mod:`maxnnx.data.protocol`.
Chat templates and fine-tuning data: :mod:`maxnnx.data.chat`, :func:`make_sft_pipeline`
and (for DPO) :func:`make_preference_pipeline`. Images for vision-language models:
:class:`ImageProcessor`, :class:`ImagePrompt` and :func:`load_image`.
"""

from maxnnx.data.chat import (
    ChatTemplate,
    encode_chat,
    encode_prompt_completion,
    load_chat_template,
)
from maxnnx.data.config import DataConfig
from maxnnx.data.images import ImageProcessor, ImagePrompt, load_image
from maxnnx.data.pipeline import Pipeline, make_pipeline
from maxnnx.data.preference import make_preference_pipeline
from maxnnx.data.protocol import (
    Checkpointable,
    DataSource,
    HasEvalBatches,
    ReportsMetrics,
    check_data_source,
)
from maxnnx.data.sft import make_sft_pipeline
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
    'DEFAULT_CORPUS', 'ChatTemplate', 'Checkpointable', 'DataConfig', 'DataSource',
    'HFTokenizer', 'HasEvalBatches', 'ImageProcessor', 'ImagePrompt', 'Pipeline',
    'ReportsMetrics', 'SentencePieceTokenizer', 'TiktokenTokenizer', 'TokenWindows',
    'Tokenizer', 'check_data_source', 'encode_chat', 'encode_prompt_completion',
    'load_chat_template', 'load_image', 'load_tokenizer', 'make_pipeline',
    'make_preference_pipeline', 'make_sft_pipeline', 'resolve_source', 'train_sentencepiece',
]
