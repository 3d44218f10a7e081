"""The maxnnx model of a benchmark config: exactly its shapes, Llama-style or Mixtral-style."""

from __future__ import annotations

from maxnnx.config import ModelConfig, MoEConfig, RopeConfig, RuntimeConfig


def model_config(cfg: dict, *, dtype: str = 'float32', remat: str = 'none', scan: bool = False,
                 attention_impl: str = 'auto', max_length: int | None = None,
                 ragged_dot_impl: str | None = None,
                 param_dtype: str = 'float32') -> ModelConfig:
  """A :class:`ModelConfig` with the shapes of benchmark config ``cfg``.

  Dense configs are ``llama`` (RMSNorm, SwiGLU, RoPE, untied embeddings); ``num_experts > 0``
  makes every layer a ``mixtral`` MoE (dropless, top-k of ``num_experts`` experts of width
  ``mlp_dim``; ``ragged_dot_impl``, by default the ``tiled`` ragged dot: on CPUs XLA's
  ``ragged_dot`` multiplies every row by every expert, and on an H100 (jax 0.11.2) its plan for
  ``gpu-moe`` needed 245 GiB, or 64 GiB for the autotuner alone, where ``tiled`` trained in
  57 GiB). Parameters are ``param_dtype`` (float32 unless asked); ``dtype`` is the compute
  dtype. ``max_length`` (default ``cfg['seq']``) sizes the rotary table.
  """
  experts = cfg.get('num_experts', 0)
  ragged = ragged_dot_impl or 'tiled'  # exact and dropless; see the docstring for why not lax
  moe = MoEConfig(num_experts=experts, num_experts_per_tok=cfg['num_experts_per_tok']
                  ) if experts else MoEConfig()
  runtime = RuntimeConfig(param_dtype=param_dtype, dtype=dtype, scan_layers=scan,
                          remat_policy=remat, attention_impl=attention_impl,
                          ragged_dot_impl=ragged if experts else 'lax')
  return ModelConfig(
      family='mixtral' if experts else 'llama', vocab_size=cfg['vocab_size'],
      d_model=cfg['d_model'], num_layers=cfg['num_layers'], num_heads=cfg['num_heads'],
      num_kv_heads=cfg['num_kv_heads'], head_dim=cfg['head_dim'], mlp_dim=cfg['mlp_dim'],
      max_position_embeddings=max(cfg['seq'], max_length or 0), norm_eps=1e-5,
      rope=RopeConfig(theta=float(cfg.get('rope_theta', 10_000.0))), moe=moe, runtime=runtime)
