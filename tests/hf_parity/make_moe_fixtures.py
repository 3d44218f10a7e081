"""Parity fixtures of the Mixture-of-Experts families (same format as make_fixtures.py).

Run by hand with torch + transformers (v5) installed:

    python tests/hf_parity/make_moe_fixtures.py [case ...]      # default: every MoE case

It reuses ``make_fixtures.py`` (inputs, generation, legacy layout, checks) and
adds: router weights scaled up so routing is decisive rather than near-uniform,
and random values for the non-parameter ``e_score_correction_bias`` buffers
(DeepSeek), which would otherwise stay zero and hide a loader that skips them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures as mf  # noqa: E402
from make_fixtures import Case  # noqa: E402

BIAS_JITTER = 0.1


def mixtral() -> Case:
    return Case(
        config=dict(
            model_type="mixtral",
            intermediate_size=48,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
        legacy=dict(rope_theta=1000000.0),
        weight_scale={"mlp.gate.weight": 4.0},
    )


def qwen3_moe() -> Case:
    return Case(
        config=dict(
            model_type="qwen3_moe",
            num_hidden_layers=3,
            head_dim=24,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[0],  # a dense first layer: two scanned stacks on our side
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
        # Hub configs spell the expert count num_experts (v5 writes num_local_experts).
        legacy=dict(rope_theta=1000000.0, num_experts=8),
        legacy_drop=("num_local_experts", "layer_types"),
        weight_scale={"mlp.gate.weight": 4.0},
    )


def deepseek_v3() -> Case:
    # YaRN factor 4 with mscale 1 / mscale_all_dim 0.8: cos/sin are scaled by
    # mscale(4, 1) / mscale(4, 0.8) and the softmax by mscale(4, 0.8) ** 2. Values are 12 wide,
    # queries/keys 24 (16 without + 8 with rope), so the kernel needs the padding path.
    scaling = dict(factor=4.0, original_max_position_embeddings=16, beta_fast=32.0,
                   beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8)
    return Case(
        config=dict(
            model_type="deepseek_v3",
            num_hidden_layers=3,
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=24,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            moe_intermediate_size=32,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            rope_interleave=True,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, **scaling),
        ),
        legacy=dict(rope_theta=10000.0, rope_scaling=dict(type="yarn", **scaling)),
        legacy_drop=("head_dim", "qk_head_dim"),
        weight_scale={"mlp.gate.weight": 4.0},
    )


def deepseek_v2() -> Case:
    # V2-Lite style: full-rank queries (q_lora_rank null), softmax routing limited to the best
    # 2 of 4 groups (group score = best expert), no renormalisation, complex-form rotary.
    scaling = dict(factor=4.0, original_max_position_embeddings=16, beta_fast=32.0,
                   beta_slow=1.0, mscale=0.707, mscale_all_dim=0.6)
    return Case(
        config=dict(
            model_type="deepseek_v2",
            num_hidden_layers=3,
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=24,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=20,
            n_routed_experts=8,
            num_experts_per_tok=3,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            moe_intermediate_size=32,
            n_shared_experts=2,
            routed_scaling_factor=1.5,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, **scaling),
        ),
        legacy=dict(rope_theta=10000.0, rope_scaling=dict(type="yarn", **scaling)),
        legacy_drop=("head_dim", "qk_head_dim"),
        weight_scale={"mlp.gate.weight": 4.0},
    )


def gpt_oss() -> Case:
    # The real rope (YaRN x32 from 4096, theta 1.5e5, truncate false: with head_dim 16 the ramp
    # runs from 2.02 to 4.35, so rounding it would move three frequencies), alternating
    # sliding/full layers with a window shorter than the input, and a SwiGLU clamp of 1.0 (7.0 in
    # the real models) so that it bites at this init. Sinks are scaled up to spread them.
    scaling = dict(factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0,
                   beta_slow=1.0, truncate=False)
    return Case(
        config=dict(
            model_type="gpt_oss",
            num_hidden_layers=4,  # layer_types [sliding, full, sliding, full]
            head_dim=16,
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=3,
            sliding_window=8,
            swiglu_limit=1.0,
            rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, **scaling),
        ),
        # The Hub layout: rope_theta + rope_scaling, plus the keys openai's configs carry.
        legacy=dict(rope_theta=150000.0, rope_scaling=dict(rope_type="yarn", **scaling),
                    experts_per_token=3, initial_context_length=4096),
        legacy_drop=("swiglu_alpha",),  # a transformers-5 key; older code fixed it at 1.702
        weight_scale={"mlp.router.weight": 4.0, "self_attn.sinks": 10.0},
    )


def llama4() -> Case:
    # Llama 4 text with every mechanism biting inside 40 tokens: chunks of 8, one NoPE layer
    # (layer 3 of 4) whose temperature steps every 4 positions (floor_scale 4, attn_scale 0.5),
    # the L2 q/k norm, interleaved rotary pairs with llama3 scaling (orig 32: all three bands),
    # and MoE layers interleaved with dense ones (moe layers 1 and 3), top-2 of 4 experts so
    # that weighting the expert inputs and summing is exercised too.
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32)
    return Case(
        config=dict(
            model_type="llama4_text",
            num_hidden_layers=4,
            head_dim=16,
            intermediate_size=32,
            intermediate_size_mlp=96,
            num_local_experts=4,
            num_experts_per_tok=2,
            interleave_moe_layer_step=2,
            attention_chunk_size=8,
            floor_scale=4,
            attn_scale=0.5,
            rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, **scaling),
        ),
        # Older Hub configs: rope_theta + rope_scaling, no layer_types (from no_rope_layers).
        legacy=dict(rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", **scaling)),
        legacy_drop=("layer_types",),
        weight_scale={"feed_forward.router.weight": 4.0},
    )


def qwen3_next() -> Case:
    # Qwen3-Next: three Gated DeltaNet layers then one gated full-attention layer; 2 key heads
    # serving 4 value heads (grouped), a 4-tap convolution, partial rotary (half of head_dim 16),
    # (1 + w) norms, a dense first layer (mlp_only_layers) and top-2 of 4 experts plus the
    # sigmoid-gated shared expert. 40 tokens run as one chunk of transformers' 64.
    return Case(
        config=dict(
            model_type="qwen3_next",
            num_hidden_layers=4,
            head_dim=16,
            intermediate_size=96,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            mlp_only_layers=[0],
            rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                 partial_rotary_factor=0.5),
        ),
        legacy=dict(rope_theta=10000.0, partial_rotary_factor=0.5),
        legacy_drop=("layer_types",),
        weight_scale={"mlp.gate.weight": 4.0},
    )


def qwen3_5() -> Case:
    # Qwen3.5's MoE text model: Qwen3-Next's stack with separate in_proj_qkv / z / b / a and
    # every layer MoE; 2 key heads serving 4 value heads, partial rotary 0.5 of head_dim 16.
    # The shared expert (48) is not a multiple of the routed experts' width (32), which
    # transformers builds and runs.
    return Case(
        config=dict(
            model_type="qwen3_5_moe_text",
            num_hidden_layers=4,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                 partial_rotary_factor=0.5),
        ),
        legacy=dict(rope_theta=10000.0, partial_rotary_factor=0.5),
        legacy_drop=("layer_types",),
        weight_scale={"mlp.gate.weight": 4.0},
        base_drop=("intermediate_size",),
    )


def deepseek_v32() -> Case:
    # DeepSeek V3.2: the deepseek_v3 case plus an 8-head lightning indexer (width 16, its first 8
    # dims rotated) keeping the best 6 keys per query, far fewer than the 40 tokens. With few
    # heads, relu zeroes whole scores and ties decide the selection (torch and XLA break ties
    # differently), so build_model checks that no selection depends on a tie.
    case = deepseek_v3()
    config = {k: v for k, v in case.config.items() if k != "rope_interleave"}
    return Case(
        config=dict(config, model_type="deepseek_v32", index_topk=6, index_n_heads=8,
                    index_head_dim=16),
        legacy=case.legacy,
        legacy_drop=case.legacy_drop + ("layer_types", "mlp_layer_types"),
        weight_scale=case.weight_scale,
    )


def gemma4_moe() -> Case:
    # Gemma 4's MoE variant: the dense MLP (width 48) and top-2 of 4 experts (width 32) side by
    # side in every layer, the router reading the residual through its own norm and scales; the
    # global layers keep a value projection here (attention_k_eq_v off, so their kv heads stay 2).
    case = mf.gemma4()
    config = {k: v for k, v in case.config.items()
              if k not in ("attention_k_eq_v", "num_global_key_value_heads")}
    return Case(
        config=dict(config, intermediate_size=48, enable_moe_block=True, num_experts=4,
                    top_k_experts=2, moe_intermediate_size=32),
        legacy=dict(global_head_dim=32),
        legacy_drop=case.legacy_drop,
        keep_rope_parameters=True,
        weight_scale={"router.proj.weight": 4.0},
    )


MOE_CASES = {f.__name__: f for f in (mixtral, qwen3_moe, deepseek_v3, deepseek_v2, gpt_oss,
                                     llama4, qwen3_next, qwen3_5, deepseek_v32, gemma4_moe)}

_plain_build = mf.build_model


def _refuse_tied_selections(indexer: torch.nn.Module) -> None:
    """Make a V3.2 indexer fail when its top-k boundary is a tie (see deepseek_v32())."""
    topk = torch.Tensor.topk

    def checked(scores, k, *args, **kwargs):
        values = topk(scores, min(k + 1, scores.shape[-1]), *args, **kwargs).values
        if values.shape[-1] > k:
            kth, next_ = values[..., k - 1], values[..., k]
            tied = (kth == next_) & torch.isfinite(next_) & (next_ > torch.finfo(next_.dtype).min)
            mf.require(not bool(tied.any()), "an indexer selection depends on a tie")
        return topk(scores, k, *args, **kwargs)

    forward = indexer.forward

    def guarded(*args, **kwargs):
        torch.Tensor.topk = checked
        try:
            return forward(*args, **kwargs)
        finally:
            torch.Tensor.topk = topk

    indexer.forward = guarded


def build_model(name: str, case: Case) -> torch.nn.Module:
    model = _plain_build(name, case)
    for module in model.modules():
        if type(module).__name__ == "DeepseekV32Indexer":
            _refuse_tied_selections(module)
    with torch.no_grad():
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.copy_(BIAS_JITTER * torch.randn_like(buffer))
        for param_name, param in model.named_parameters():
            if param_name.endswith("proj_bias"):  # GPT-OSS expert biases [E, *]: zero-initialised
                param.add_(mf.VECTOR_JITTER * torch.randn_like(param))
    return model


_plain_checks = mf.check_softcaps_bite


@torch.no_grad()
def check_features_bite(model: torch.nn.Module, input_ids: torch.Tensor, logits) -> None:
    """GPT-OSS (the sinks, the YaRN ramp rounding, the SwiGLU clamp) and Llama 4 (chunks, the
    NoPE temperature, the L2 q/k norm): dropping each must move the logits by at least ten
    times the parity tolerance (1e-4 of the largest logit)."""
    _plain_checks(model, input_ids, logits)
    if model.config.model_type == "llama4_text":
        changed = {
            "chunks": dict(config={"attention_chunk_size": 1024}),
            "temperature": dict(config={"attn_temperature_tuning": False}),
            "qk_norm": dict(config={"use_qk_norm": False}),
        }
    elif model.config.model_type != "gpt_oss":
        return
    else:
        changed = gpt_oss_changes(model)
    for name, change in changed.items():
        config = model.config.__class__(**{**model.config.to_dict(), **change.get("config", {})})
        other = AutoModelForCausalLM.from_config(config).eval()
        other.load_state_dict(change.get("state", model.state_dict()))
        diff = mf.max_diff(mf.logits_of(other, input_ids), logits)
        print(f"  dropping {name} changes logits by {diff:.3f}")
        floor = 10 * 1e-4 * float(abs(logits).max())
        mf.require(diff > floor, f"{name} barely bites ({diff} <= {floor})")


def gpt_oss_changes(model: torch.nn.Module) -> dict:
    """GPT-OSS: the sinks, the YaRN ramp rounding and the SwiGLU clamp."""
    return {
        "sinks": dict(state={k: torch.full_like(v, -1e4) if k.endswith("sinks") else v
                             for k, v in model.state_dict().items()}),
        "truncate": dict(config={"rope_parameters": {**model.config.rope_parameters,
                                                     "truncate": True}}),
        "swiglu_limit": dict(config={"swiglu_limit": 1e4}),
    }


def main() -> None:
    mf.CASES.update(MOE_CASES)
    mf.build_model = build_model
    mf.check_softcaps_bite = check_features_bite
    names = sys.argv[1:] or list(MOE_CASES)
    unknown = set(names) - set(MOE_CASES)
    if unknown:
        raise SystemExit(f"unknown case(s) {sorted(unknown)}; choose from {', '.join(MOE_CASES)}")
    for name in names:
        mf.write_case(name)


if __name__ == "__main__":
    main()
