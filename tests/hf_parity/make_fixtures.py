"""Build tiny random Hugging Face models and write parity fixtures for the JAX tests.

This is a developer tool, run by hand in an environment that has torch and
transformers (v5) installed; the test suite itself never imports torch:

    python tests/hf_parity/make_fixtures.py [case ...]      # default: every case

For each case it rewrites ``tests/fixtures/hf/<case>/``:

* ``config.json`` + ``model.safetensors``: exactly what ``save_pretrained`` writes
  in transformers 5 (float32, ``rope_parameters`` layout).
* ``legacy/config.json``: the same model described in the older Hub layout
  (``rope_theta`` + ``rope_scaling`` with per-family spellings, no ``layer_types``
  where old configs had none).  It pairs with the weights one level up.  The
  script checks that transformers loads it to the same logits.
* ``reference.npz``: ``input_ids`` int32 [2, 40] and their ``logits`` float32
  [2, 40, vocab] (plain causal, no attention mask), plus ``gen_prompt`` int32
  [1, 8] and ``gen_output`` int32 [1, 20] from greedy ``generate`` with a KV cache
  and no EOS.

Every case seeds torch from its own name, so reruns give identical files.  Each
model is tiny and uses non-default settings (GQA, explicit head_dim, scaled
RoPE, sliding windows, soft-capping, ...); every 1-D parameter (norm weights,
biases) is jittered away from its 0/1 init so that a loader which skips a tensor
fails the parity test.

The lead can also check a directory written by our own ``save_pretrained``:

    python tests/hf_parity/make_fixtures.py --verify-export DIR CASE
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

FIXTURES_DIR = Path(__file__).resolve().parent.parent / "fixtures" / "hf"

BATCH, SEQ_LEN = 2, 40
PROMPT_LEN, NEW_TOKENS = 8, 12
GEN_PAD_ID = 0
VECTOR_JITTER = 0.1  # std of the noise added to every norm weight and bias
LEGACY_TOL = 1e-6
EXPORT_TOL = 1e-4

# Shared by every case; each case overrides what it needs.
BASE_CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.08,
    dtype="float32",
    # No special tokens: no zeroed padding row in the embedding, no early stop in generate.
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


@dataclass(frozen=True)
class Case:
    config: dict  # overrides of BASE_CONFIG, v5 spelling (must include model_type)
    legacy: dict  # keys set in legacy/config.json after `rope_parameters` is removed
    legacy_drop: tuple[str, ...] = ()  # further keys old Hub configs did not have
    weight_scale: dict[str, float] = field(default_factory=dict)  # name fragment -> multiplier
    base_drop: tuple[str, ...] = ()  # BASE_CONFIG keys the family spells differently
    keep_rope_parameters: bool = False  # the older layout has rope_parameters too (Gemma 4)


# --------------------------------------------------------------------------- cases


def llama() -> Case:
    # original_max_position_embeddings=32 (not 16) so that all three llama3 branches occur with
    # head_dim 24 and theta 5e5: wavelengths 2pi (< 32/4, kept), 18.7 (smoothed), >= 56 (/ factor).
    scaling = dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=32,
    )
    return Case(
        config=dict(
            model_type="llama",
            head_dim=24,  # hidden 64 / 4 heads would be 16
            rope_parameters=dict(rope_theta=500000.0, **scaling),
            tie_word_embeddings=False,
        ),
        legacy=dict(rope_theta=500000.0, rope_scaling=scaling),
    )


def mistral() -> Case:
    return Case(
        config=dict(
            model_type="mistral",
            sliding_window=8,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
        legacy=dict(rope_theta=1000000.0),
        legacy_drop=("head_dim",),  # old Mistral configs had none: hidden / heads
    )


def qwen2() -> Case:
    # With head_dim 16, an original length of 16 would make the YaRN ramp a hard 0/1 step; at 256
    # (theta 1e6) the extrapolation weights per frequency are [1, 2/3, 1/3, 0, ...].
    scaling = dict(factor=4.0, original_max_position_embeddings=256)
    return Case(
        config=dict(
            model_type="qwen2",
            max_position_embeddings=1024,  # = factor * original
            tie_word_embeddings=True,
            initializer_range=0.15,  # keeps greedy decoding from echoing the tied embedding
            rope_parameters=dict(rope_type="yarn", rope_theta=1000000.0, **scaling),
            use_sliding_window=False,
            max_window_layers=1,
        ),
        # Real Qwen2 configs carry a sliding_window that is ignored because use_sliding_window is
        # false; here it is small enough (8 < 40) that honouring it would change the logits.
        legacy=dict(
            rope_theta=1000000.0,
            rope_scaling=dict(type="yarn", **scaling),
            use_sliding_window=False,
            sliding_window=8,
            max_window_layers=1,
        ),
        legacy_drop=("layer_types",),
    )


def qwen3() -> Case:
    return Case(
        config=dict(
            model_type="qwen3",
            num_hidden_layers=3,
            head_dim=24,
            rope_parameters=dict(rope_type="linear", rope_theta=20000.0, factor=2.0),
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,  # -> layer_types [full, sliding, sliding]
        ),
        legacy=dict(rope_theta=20000.0, rope_scaling=dict(type="linear", factor=2.0)),
        legacy_drop=("layer_types",),
    )


def gemma() -> Case:
    return Case(
        config=dict(
            model_type="gemma",
            num_key_value_heads=1,  # MQA
            head_dim=32,
            # Larger init so the layers outweigh the sqrt(hidden)-scaled tied embedding; otherwise
            # greedy decoding just repeats its input token.
            initializer_range=0.3,
            hidden_act="gelu_pytorch_tanh",
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
        # Gemma 1 Hub configs say "gelu" but mean the tanh approximation (transformers remaps it).
        legacy=dict(rope_theta=10000.0, hidden_act="gelu"),
    )


def gemma2() -> Case:
    # Small caps and sharpened q/k make both tanh soft-caps clearly non-linear without saturating
    # them (pre-cap attention scores: std ~1.7, max ~8; final logits: std ~0.4, max ~1.6), while
    # the small init keeps greedy generation from collapsing to one token.
    return Case(
        config=dict(
            model_type="gemma2",
            num_hidden_layers=4,  # layer_types [sliding, full, sliding, full]
            head_dim=32,
            query_pre_attn_scalar=24,
            initializer_range=0.05,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=1.0,
            sliding_window=8,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
        legacy=dict(rope_theta=10000.0),
        legacy_drop=("layer_types",),
        weight_scale={"q_proj": 3.0, "k_proj": 3.0},
    )


def gemma3() -> Case:
    pattern = 3
    layers = 6
    return Case(
        config=dict(
            model_type="gemma3_text",
            num_hidden_layers=layers,
            intermediate_size=96,
            head_dim=24,
            query_pre_attn_scalar=48,
            initializer_range=0.05,  # post-norms: a small init keeps greedy decoding varied
            sliding_window=8,
            layer_types=[  # every `pattern`-th layer is global
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                for i in range(layers)
            ],
            rope_parameters=dict(
                full_attention=dict(rope_type="linear", factor=8.0, rope_theta=100000.0),
                sliding_attention=dict(rope_type="default", rope_theta=10000.0),
            ),
        ),
        legacy=dict(
            rope_theta=100000.0,
            rope_local_base_freq=10000.0,
            rope_scaling=dict(rope_type="linear", factor=8.0),
            sliding_window_pattern=pattern,
        ),
        # v5 also writes a stale private "_sliding_window_pattern" (6); layer_types is what counts.
        legacy_drop=("layer_types", "_sliding_window_pattern"),
    )


def phi3() -> Case:
    hidden, heads, partial = 64, 2, 0.5  # head_dim 32, rotary dim 16
    n_freq = int(hidden // heads * partial) // 2
    rng = np.random.default_rng(3)
    short_factor = [round(float(x), 3) for x in rng.uniform(1.0, 4.0, n_freq)]
    long_factor = [round(float(x), 3) for x in rng.uniform(1.0, 4.0, n_freq)]
    factors = dict(short_factor=short_factor, long_factor=long_factor)
    return Case(
        config=dict(
            model_type="phi3",
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=1,
            # max_position_embeddings 64 / original 16 -> factor 4, attention_factor sqrt(1.5).
            # The 40-token reference runs on the long factors; generate runs its prompt and first
            # decode steps on the short ones and switches to long at position 16.
            original_max_position_embeddings=16,
            sliding_window=None,
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=10000.0,
                partial_rotary_factor=partial,
                original_max_position_embeddings=16,
                **factors,
            ),
        ),
        legacy=dict(
            rope_theta=10000.0,
            partial_rotary_factor=partial,
            rope_scaling=dict(type="longrope", **factors),
        ),
    )


def olmo2() -> Case:
    return Case(
        config=dict(
            model_type="olmo2",
            rope_parameters=dict(rope_type="default", rope_theta=500000.0),
        ),
        legacy=dict(rope_theta=500000.0, rope_scaling=None),
    )


def olmo3() -> Case:
    # YaRN on the full-attention layer only; sliding layers keep plain rope at the same base.
    # head_dim 32 and original 64 give a graded YaRN ramp (extrapolation weights 1, 2/3, 1/3, 0,
    # ...), and the explicit attention_factor differs from the derived 0.1 ln 4 + 1.
    # layer_types is not OLMo 3's default pattern, so a loader that ignores it fails.
    scaling = dict(factor=4.0, original_max_position_embeddings=64, attention_factor=1.2,
                   beta_fast=32.0, beta_slow=1.0)
    return Case(
        config=dict(
            model_type="olmo3",
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=256,  # = factor * original
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention",
                         "sliding_attention"],
            rope_parameters=dict(
                full_attention=dict(rope_type="yarn", rope_theta=500000.0, **scaling),
                sliding_attention=dict(rope_type="default", rope_theta=500000.0),
            ),
        ),
        # The Hub's OLMo 3 configs (written by transformers 4.57) keep layer_types and give
        # rope_theta + rope_scaling. transformers 5.23 then gives sliding layers its class
        # default theta (5e5) whatever rope_theta says; every release uses 5e5, as here.
        legacy=dict(rope_theta=500000.0, rope_scaling=dict(rope_type="yarn", **scaling)),
    )


def gpt2() -> Case:
    # The GPT-2 layout of maxnnx's gpt3 family: learned positions, LayerNorm with biases,
    # Conv1D weights [in, out] with q/k/v fused in attn.c_attn, tied output.
    return Case(
        config=dict(
            model_type="gpt2",
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_inner=96,  # not 4 * n_embd
            n_positions=64,
            layer_norm_epsilon=1e-4,
            activation_function="gelu_new",
            tie_word_embeddings=True,
            initializer_range=0.4,  # below ~0.3 greedy decoding repeats one token
        ),
        # Hub GPT-2 configs also carry n_ctx and leave tie_word_embeddings to the default.
        legacy=dict(n_ctx=64),
        legacy_drop=("tie_word_embeddings",),
        base_drop=("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "max_position_embeddings", "initializer_range"),
    )


def gemma4() -> Case:
    # Gemma 4 (dense): sliding window 8 in layers 0 and 2, wider global layers 1 and 3 (head 32
    # against 16, one key/value head whose values are its un-normed keys), proportional rope on
    # the global layers (a quarter of the pairs turn, factor 2), value norms, layer scalars and a
    # final soft-cap small enough to bite.
    return Case(
        config=dict(
            model_type="gemma4_text",
            num_hidden_layers=4,
            intermediate_size=96,
            head_dim=16,
            global_head_dim=32,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            hidden_size_per_layer_input=0,
            initializer_range=0.05,
            sliding_window=8,
            final_logit_softcapping=2.0,
            layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters=dict(
                full_attention=dict(rope_type="proportional", partial_rotary_factor=0.25,
                                    rope_theta=100000.0, factor=2.0),
                sliding_attention=dict(rope_type="default", rope_theta=10000.0),
            ),
        ),
        # The Hub release layout: global_head_dim / num_global_key_value_heads, no
        # per_layer_config (transformers >= 5.2 saves the latter).
        legacy=dict(global_head_dim=32, num_global_key_value_heads=1),
        legacy_drop=("per_layer_config",),
        keep_rope_parameters=True,
    )


def gemma4_small() -> Case:
    # Gemma 4 E2B/E4B's mechanisms: per-layer inputs of width 8 (a token table plus a normed
    # projection of the embedding, gated into every layer), and the last 3 of 6 layers attending
    # with the keys/values of layer 1 (full) or 2 (sliding), with doubled MLPs; the global layers
    # keep their value projection (no attention_k_eq_v), as in E2B/E4B.
    case = gemma4()
    config = {k: v for k, v in case.config.items()
              if k not in ("attention_k_eq_v", "num_global_key_value_heads")}
    return Case(
        config=dict(config, num_hidden_layers=6, layer_types=["sliding_attention",
                                                               "full_attention"] * 3,
                    hidden_size_per_layer_input=8, vocab_size_per_layer_input=256,
                    num_kv_shared_layers=3, use_double_wide_mlp=True),
        legacy=dict(global_head_dim=32),
        legacy_drop=case.legacy_drop,
        keep_rope_parameters=True,
    )


CASES = {
    f.__name__: f
    for f in (llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3, gemma4, gemma4_small, phi3,
              olmo2, olmo3, gpt2)
}


# ------------------------------------------------------------------------ building


def case_seed(name: str) -> int:
    return zlib.crc32(name.encode())


def build_model(name: str, case: Case) -> torch.nn.Module:
    torch.manual_seed(case_seed(name))
    base = {k: v for k, v in BASE_CONFIG.items() if k not in case.base_drop}
    config = AutoConfig.for_model(**{**base, **case.config})
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():  # tied weights appear once
            if param.ndim == 1:  # norm weights (0- or 1-initialised) and biases
                param.add_(VECTOR_JITTER * torch.randn_like(param))
            for fragment, scale in case.weight_scale.items():
                if fragment in param_name:
                    param.mul_(scale)
        for buffer_name, buffer in model.named_buffers():  # Gemma 4's per-layer output scale
            if buffer_name.endswith("layer_scalar"):
                buffer.copy_(1.0 + 2 * VECTOR_JITTER * torch.randn_like(buffer))
    return model


def make_inputs(name: str, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(case_seed(name) + 1)
    input_ids = torch.randint(0, vocab_size, (BATCH, SEQ_LEN), generator=gen)
    gen_prompt = torch.randint(0, vocab_size, (1, PROMPT_LEN), generator=gen)
    return input_ids, gen_prompt


@torch.no_grad()
def logits_of(model: torch.nn.Module, input_ids: torch.Tensor) -> np.ndarray:
    return model(input_ids).logits.float().numpy()


@torch.no_grad()
def greedy(model: torch.nn.Module, prompt: torch.Tensor) -> np.ndarray:
    out = model.generate(
        prompt,
        # Explicit: otherwise generate masks prompt tokens equal to the pad id.
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=GEN_PAD_ID,
        use_cache=True,
    )
    require(out.shape == (1, PROMPT_LEN + NEW_TOKENS), f"generate gave shape {tuple(out.shape)}")
    return out.numpy()


def check_generation_varied(gen_output: np.ndarray, min_distinct: int = 4) -> None:
    """A continuation that repeats one token would hardly test the KV cache."""
    new_tokens = gen_output[0, PROMPT_LEN:]
    require(len(set(new_tokens.tolist())) >= min_distinct, f"degenerate continuation {new_tokens}")


def load_checked(path: Path) -> torch.nn.Module:
    """from_pretrained in float32, failing if any tensor is missing, unexpected or mis-shaped."""
    model, info = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    problems = {kind: keys for kind, keys in info.items() if keys}
    require(not problems, f"loading {path} reported {problems}")
    return model.eval()


def require(condition: bool, message: str) -> None:
    """Like assert, but survives `python -O`."""
    if not condition:
        raise AssertionError(message)


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


def legacy_config(saved: dict, case: Case) -> dict:
    drop = {"dtype", *case.legacy_drop} | (set() if case.keep_rope_parameters
                                            else {"rope_parameters"})
    legacy = {k: v for k, v in saved.items() if k not in drop}
    legacy["torch_dtype"] = saved["dtype"]  # pre-v5 spelling
    legacy["transformers_version"] = "4.51.3"
    legacy.update(case.legacy)
    return dict(sorted(legacy.items()))


def load_with_weights_of(config: dict, case_dir: Path) -> torch.nn.Module:
    """Load `config` together with case_dir's weights (what the JAX test does for legacy/)."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        (Path(tmp) / "model.safetensors").symlink_to((case_dir / "model.safetensors").resolve())
        return load_checked(Path(tmp))


def check_softcaps_bite(model: torch.nn.Module, input_ids: torch.Tensor, logits: np.ndarray):
    """Each configured soft-cap must change the logits a lot when removed."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(model.config, key, None) is None:
            continue
        config = model.config.__class__(**{**model.config.to_dict(), key: None})
        uncapped = AutoModelForCausalLM.from_config(config).eval()
        uncapped.load_state_dict(model.state_dict())
        diff = max_diff(logits_of(uncapped, input_ids), logits)
        print(f"  removing {key}={getattr(model.config, key)} changes logits by {diff:.3f}")
        require(diff > 0.1, f"{key} barely bites ({diff})")


def write_case(name: str) -> None:
    case = CASES[name]()
    out = FIXTURES_DIR / name
    shutil.rmtree(out, ignore_errors=True)
    print(f"[{name}]")

    model = build_model(name, case)
    input_ids, gen_prompt = make_inputs(name, model.config.vocab_size)
    logits = logits_of(model, input_ids)
    gen_output = greedy(model, gen_prompt)

    model.save_pretrained(out)
    (out / "generation_config.json").unlink(missing_ok=True)  # our loader must not need it
    saved = json.loads((out / "config.json").read_text())

    reloaded = load_checked(out)
    diff = max_diff(logits_of(reloaded, input_ids), logits)
    require(diff == 0.0, f"{name}: save/reload changed logits by {diff}")

    legacy = legacy_config(saved, case)
    legacy_model = load_with_weights_of(legacy, out)
    diff = max_diff(logits_of(legacy_model, input_ids), logits)
    print(f"  legacy config vs v5 config: max |dlogits| = {diff:.2e}")
    require(diff < LEGACY_TOL, f"{name}: legacy config gives different logits ({diff})")
    require(
        np.array_equal(greedy(legacy_model, gen_prompt), gen_output),
        f"{name}: legacy config generates differently",
    )
    (out / "legacy").mkdir()
    (out / "legacy" / "config.json").write_text(json.dumps(legacy, indent=2) + "\n")

    check_softcaps_bite(model, input_ids, logits)
    check_generation_varied(gen_output)

    np.savez(
        out / "reference.npz",
        input_ids=input_ids.numpy().astype(np.int32),
        logits=logits.astype(np.float32),
        gen_prompt=gen_prompt.numpy().astype(np.int32),
        gen_output=gen_output.astype(np.int32),
    )
    print(
        f"  layer_types={getattr(model.config, 'layer_types', None)}\n"
        f"  logits std {logits.std():.3f}, max |logit| {np.abs(logits).max():.3f}; "
        f"generated {gen_output[0, PROMPT_LEN:].tolist()}"
    )


def print_sizes() -> None:
    total = 0
    for path in sorted(FIXTURES_DIR.rglob("*")):
        if path.is_file():
            total += path.stat().st_size
            print(f"{path.stat().st_size:>10,d}  {path.relative_to(FIXTURES_DIR)}")
    print(f"{total:>10,d}  total")


# -------------------------------------------------------------------- export check


def verify_export(path: str | Path, case: str) -> float:
    """Check that transformers loads a directory written by our `save_pretrained`.

    Runs it on the case's reference input_ids and compares with the stored logits.
    Returns the max abs difference; raises AssertionError above EXPORT_TOL.
    """
    ref = np.load(FIXTURES_DIR / case / "reference.npz")
    model = load_checked(Path(path))
    diff = max_diff(logits_of(model, torch.from_numpy(ref["input_ids"]).long()), ref["logits"])
    print(f"{case}: {path} vs reference: max |dlogits| = {diff:.3e} (tolerance {EXPORT_TOL:g})")
    require(diff < EXPORT_TOL, f"exported {case} model does not match the reference ({diff})")
    return diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", help=f"any of {', '.join(CASES)} (default: all)")
    parser.add_argument("--verify-export", nargs=2, metavar=("DIR", "CASE"))
    args = parser.parse_args()

    if args.verify_export:
        path, case = args.verify_export
        if case not in CASES:
            parser.error(f"unknown case {case!r}; choose from {', '.join(CASES)}")
        verify_export(path, case)
        return

    unknown = set(args.cases) - set(CASES)
    if unknown:
        parser.error(f"unknown case(s) {sorted(unknown)}; choose from {', '.join(CASES)}")
    for name in args.cases or CASES:
        write_case(name)
    print_sizes()


if __name__ == "__main__":
    main()
