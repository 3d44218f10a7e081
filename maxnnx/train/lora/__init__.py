"""LoRA and QLoRA fine-tuning through qwix: adapters, merging, and PEFT's adapter format.

::

  from maxnnx.train.lora import LoraConfig, apply_lora, merge_adapters, save_adapter

  model = apply_lora(maxnnx.from_pretrained(base_dir), LoraConfig(rank=8, alpha=16))
  trainer = Trainer(model, TrainConfig(...))   # trains the adapters only
  trainer.fit()
  save_adapter(trainer.model, 'out/adapter')   # PEFT's adapter_config.json + safetensors
  maxnnx.save_pretrained(merge_adapters(trainer.model), 'out/final')

``config`` holds :class:`LoraConfig`, ``adapters`` the qwix adapters on a model
(apply, merge, switch off, the trainable filter) and ``peft`` the adapter files.
"""

from maxnnx.train.lora.adapters import (
  adapter_weights,
  apply_lora,
  has_adapters,
  lora_config_of,
  merge_adapters,
  target_modules,
  trainable_filter,
  without_adapters,
  without_adapters_logps,
)
from maxnnx.train.lora.config import ALL_LINEAR, LoraConfig
from maxnnx.train.lora.peft import load_adapter, save_adapter

__all__ = ['ALL_LINEAR', 'LoraConfig', 'adapter_weights', 'apply_lora', 'has_adapters',
           'load_adapter', 'lora_config_of', 'merge_adapters', 'save_adapter', 'target_modules',
           'trainable_filter', 'without_adapters', 'without_adapters_logps']
