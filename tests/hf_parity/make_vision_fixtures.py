"""Parity fixtures of the multimodal models (images + text), format of make_fixtures.py.

Run by hand with torch + transformers (v5) installed:

    python tests/hf_parity/make_vision_fixtures.py [case ...]      # default: every case

Each case directory holds the checkpoint (``config.json``, ``model.safetensors``),
``legacy/config.json`` (the older Hub layout) and ``reference.npz``: ``input_ids`` with
image placeholders, ``pixel_values``, ``token_type_ids``, ``logits`` (with the images,
image tokens attending to each other in both directions) and ``text_logits`` (the same
ids with the placeholders replaced by text tokens, no images). ``llama4_vision`` is a
``Llama4ForConditionalGeneration`` (tiles of a pixel-shuffled tower, plain causal text
attention) with the same references but no ``token_type_ids``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForImageTextToText

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures as mf  # noqa: E402

VOCAB, IMAGE_ID, BOI_ID, EOI_ID = 300, 299, 297, 298


def gemma3_vision():
    # Gemma 3 with a 2-layer SigLIP tower on 32x32 images of 4x4 patches (8x8 grid), pooled
    # 2x2 to 16 tokens per image; text windows of 8 so that an image (16 tokens) is wider
    # than the window and its bidirectional block crosses it.
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"],
                max_position_embeddings=128, initializer_range=0.05,
                rope_parameters=dict(full_attention=dict(rope_type="linear", factor=2.0,
                                                         rope_theta=100000.0),
                                     sliding_attention=dict(rope_type="default",
                                                            rope_theta=10000.0)),
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  image_size=32, patch_size=4, vision_use_head=False)
    config = dict(model_type="gemma3", text_config=text, vision_config=vision,
                  mm_tokens_per_image=16, image_token_index=IMAGE_ID, boi_token_index=BOI_ID,
                  eoi_token_index=EOI_ID, dtype="float32")
    legacy_text = {k: v for k, v in text.items() if k not in ("rope_parameters", "layer_types")}
    legacy_text.update(rope_theta=100000.0, rope_local_base_freq=10000.0,
                       rope_scaling=dict(rope_type="linear", factor=2.0),
                       sliding_window_pattern=2)
    return config, legacy_text


CASES = {"gemma3_vision": gemma3_vision}


def inputs(gen: torch.Generator, tokens_per_image: int, image_size: int):
    """Two rows of 40 tokens: text, <boi>, an image's placeholders, <eoi>, text (the image
    at different offsets); the second row holds a second image too."""
    rows, images = [], 0
    for starts in ((5,), (2, 20)):
        row = torch.randint(0, BOI_ID, (40,), generator=gen)
        for start in starts:
            row[start] = BOI_ID
            row[start + 1:start + 1 + tokens_per_image] = IMAGE_ID
            row[start + 1 + tokens_per_image] = EOI_ID
            images += 1
        rows.append(row)
    ids = torch.stack(rows)
    pixels = torch.randn((images, 3, image_size, image_size), generator=gen)
    return ids, pixels


def save_with_legacy_top(model, out: Path) -> tuple[dict, dict]:
    """Save ``model`` into ``out``; return its config and the config's top level as
    transformers 4 wrote it (``torch_dtype``, a 4.x version), for the legacy layout."""
    model.save_pretrained(out)
    (out / "generation_config.json").unlink(missing_ok=True)
    saved = json.loads((out / "config.json").read_text())
    legacy = {k: v for k, v in saved.items() if k != "dtype"}
    legacy["torch_dtype"] = saved["dtype"]
    legacy["transformers_version"] = "4.51.3"
    return saved, legacy


def write_case(name: str) -> None:
    import shutil
    config, legacy_text = CASES[name]()
    out = mf.FIXTURES_DIR / name
    shutil.rmtree(out, ignore_errors=True)
    print(f"[{name}]")
    torch.manual_seed(mf.case_seed(name))
    from transformers import AutoConfig
    hf_config = AutoConfig.for_model(**config)
    model = AutoModelForImageTextToText.from_config(hf_config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param.ndim == 1:
                param.add_(mf.VECTOR_JITTER * torch.randn_like(param))
            if "mm_input_projection_weight" in param_name:  # zero-initialised
                param.copy_(0.2 * torch.randn_like(param))
    gen = torch.Generator().manual_seed(mf.case_seed(name) + 1)
    ids, pixels = inputs(gen, config["mm_tokens_per_image"], config["vision_config"]["image_size"])
    token_type_ids = (ids == IMAGE_ID).long()
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=pixels, token_type_ids=token_type_ids).logits
        causal = model(input_ids=ids, pixel_values=pixels).logits
        text_ids = torch.where(ids == IMAGE_ID, torch.full_like(ids, 7), ids)
        text_logits = model(input_ids=text_ids).logits
    diff = float((logits - causal).abs().max())
    print(f"  bidirectional image blocks change logits by {diff:.3f}")
    mf.require(diff > 1e-2, "the image blocks barely bite")
    saved, legacy = save_with_legacy_top(model, out)
    legacy["text_config"] = dict(sorted({**legacy_text, "model_type": "gemma3_text"}.items()))
    (out / "legacy").mkdir()
    (out / "legacy" / "config.json").write_text(json.dumps(legacy, indent=2) + "\n")
    legacy_cfg = AutoConfig.for_model(**{k: v for k, v in legacy.items()
                                         if k not in ("torch_dtype", "transformers_version")})
    legacy_model = AutoModelForImageTextToText.from_config(legacy_cfg).eval()
    legacy_model.load_state_dict(model.state_dict())
    with torch.no_grad():
        legacy_logits = legacy_model(input_ids=ids, pixel_values=pixels,
                                     token_type_ids=token_type_ids).logits
    legacy_diff = float((legacy_logits - logits).abs().max())
    print(f"  legacy config vs v5 config: max |dlogits| = {legacy_diff:.2e}")
    mf.require(legacy_diff < mf.LEGACY_TOL, "legacy config gives different logits")
    # Greedy generation from a prompt with one image (prefill with the image block).
    prompt = torch.cat([torch.tensor([[11, 12, 13, BOI_ID]]),
                        torch.full((1, config["mm_tokens_per_image"]), IMAGE_ID),
                        torch.tensor([[EOI_ID, 14, 15]])], dim=1)
    with torch.no_grad():
        gen = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                             pixel_values=pixels[:1], token_type_ids=(prompt == IMAGE_ID).long(),
                             max_new_tokens=mf.NEW_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    print(f"  generated {gen[0, prompt.shape[1]:].tolist()}")
    np.savez(out / "reference.npz", input_ids=ids.numpy(), pixel_values=pixels.numpy(),
             token_type_ids=token_type_ids.numpy(), logits=logits.float().numpy(),
             text_ids=text_ids.numpy(), text_logits=text_logits.float().numpy(),
             gen_prompt=prompt.numpy(), gen_output=gen.numpy())
    print(f"  logits std {float(logits.std()):.3f}, max |logit| {float(logits.abs().max()):.3f}")


# Llama 4: <|patch|> placeholders take the features; the other image tokens stay text.
L4_START, L4_END, L4_IMAGE, L4_TILE_X, L4_TILE_Y = 290, 291, 292, 293, 294


def llama4_vision():
    # A 2-layer Llama 4 tower on 56x56 tiles of 14x14 patches (4x4 grid), pixel-shuffled
    # (ratio 0.5) to 4 tokens per tile; text: a dense layer then an MoE layer, chunked
    # attention of 8 positions so that chunks cut through the images.
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
                intermediate_size_mlp=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_local_experts=2, num_experts_per_tok=1,
                interleave_moe_layer_step=2, attention_chunk_size=8,
                max_position_embeddings=128, initializer_range=0.05,
                rope_parameters=dict(rope_type="default", rope_theta=50000.0),
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
    vision = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                  intermediate_size=128, image_size=56, patch_size=14, pixel_shuffle_ratio=0.5,
                  projector_input_dim=48, projector_output_dim=48, vision_output_dim=48,
                  rope_parameters=dict(rope_type="default", rope_theta=10000.0))
    config = dict(model_type="llama4", text_config=text, vision_config=vision,
                  image_token_index=IMAGE_ID, boi_token_index=L4_START,
                  eoi_token_index=L4_END, dtype="float32")
    return config


def llama4_image_tokens(tiles_h: int, tiles_w: int, per_tile: int) -> list[int]:
    """The processor's token string of one image of ``tiles_h x tiles_w`` tiles (plus the
    global tile when there are several)."""
    ids = [L4_START]
    if tiles_h * tiles_w > 1:
        for _ in range(tiles_h):
            for x in range(tiles_w):
                ids += [IMAGE_ID] * per_tile + ([L4_TILE_X] if x < tiles_w - 1 else [])
            ids.append(L4_TILE_Y)
    return ids + [L4_IMAGE] + [IMAGE_ID] * per_tile + [L4_END]


def write_llama4_case(name: str) -> None:
    import shutil

    from transformers import AutoConfig
    config = llama4_vision()
    out = mf.FIXTURES_DIR / name
    shutil.rmtree(out, ignore_errors=True)
    print(f"[{name}]")
    torch.manual_seed(mf.case_seed(name))
    model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(**config)).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(mf.VECTOR_JITTER * torch.randn_like(param))
    per_tile = 4
    gen = torch.Generator().manual_seed(mf.case_seed(name) + 1)
    # Row 0: one single-tile image; row 1: an image of 2x1 tiles (+ its global tile), then
    # a single-tile one. 48 tokens each.
    rows, tiles = [], 0
    for images in (((1, 1),), ((2, 1), (1, 1))):
        row = torch.randint(0, L4_START, (48,), generator=gen).tolist()
        at = 3
        for th, tw in images:
            piece = llama4_image_tokens(th, tw, per_tile)
            row[at:at + len(piece)] = piece
            at += len(piece) + 2
            tiles += th * tw + (th * tw > 1)
        rows.append(row[:48])
    ids = torch.tensor(rows)
    pixels = torch.randn((tiles, 3, 56, 56), generator=gen)
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=pixels).logits
        text_ids = torch.where(ids == IMAGE_ID, torch.full_like(ids, 7), ids)
        text_logits = model(input_ids=text_ids).logits
    saved, legacy = save_with_legacy_top(model, out)
    for part in ("text_config", "vision_config"):
        sub = {k: v for k, v in saved[part].items() if k != "rope_parameters"}
        sub["rope_theta"] = saved[part]["rope_parameters"]["rope_theta"]
        legacy[part] = sub
    (out / "legacy").mkdir()
    (out / "legacy" / "config.json").write_text(json.dumps(legacy, indent=2) + "\n")
    np.savez(out / "reference.npz", input_ids=ids.numpy(), pixel_values=pixels.numpy(),
             logits=logits.float().numpy(), text_ids=text_ids.numpy(),
             text_logits=text_logits.float().numpy())
    print(f"  {tiles} tiles; logits std {float(logits.std()):.3f}, max |logit| "
          f"{float(logits.abs().max()):.3f}")


IMAGES_DIR = mf.FIXTURES_DIR.parent / "images"


def write_images() -> None:
    """Three small PNGs (landscape, portrait, RGBA square) and what transformers' Pillow
    Gemma 3 image processor makes of them: with pan-and-scan at 32x32, and plain bicubic
    at 40x48; the gemma3_vision checkpoint gets the first as its preprocessor_config.json."""
    from PIL import Image
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    IMAGES_DIR.mkdir(exist_ok=True)
    rng = np.random.default_rng(3)
    paths = []
    for name, (h, w, c) in {"landscape": (30, 90, 3), "portrait": (60, 24, 3),
                            "square_rgba": (40, 40, 4)}.items():
        yy, xx = np.mgrid[0:h, 0:w]
        smooth = np.stack([(xx * 255 / w), (yy * 255 / h), ((xx + yy) * 127 / (h + w))], -1)
        pixels = np.clip(smooth + rng.normal(0, 25, (h, w, 3)), 0, 255).astype(np.uint8)
        if c == 4:
            pixels = np.concatenate([pixels, rng.integers(0, 256, (h, w, 1), np.uint8)], -1)
        path = IMAGES_DIR / f"{name}.png"
        Image.fromarray(pixels).save(path)
        paths.append(path)
    images = [Image.open(p) for p in paths]
    scan = write_gemma3_processor_outputs(Gemma3ImageProcessorPil, images, "gemma3_processor")
    scan.save_pretrained(mf.FIXTURES_DIR / "gemma3_vision")


def write_gemma3_processor_outputs(processor_class, images, name: str):
    """``<name>.npz``: ``processor_class`` on ``images`` at 32x32 with pan-and-scan (crops
    of >= 8 pixels, at most 3) and plain bicubic at 40x48; returns the pan-and-scan one."""
    scan = processor_class(size={"height": 32, "width": 32}, do_pan_and_scan=True,
                           pan_and_scan_min_crop_size=8, pan_and_scan_max_num_crops=3,
                           pan_and_scan_min_ratio_to_activate=1.2)
    plain = processor_class(size={"height": 40, "width": 48}, resample=3)
    scanned = scan(images, return_tensors="np")
    flat = plain(images, return_tensors="np")
    np.savez(IMAGES_DIR / f"{name}.npz", scan_pixels=np.asarray(scanned["pixel_values"]),
             scan_crops=np.asarray(scanned["num_crops"]),
             plain_pixels=np.asarray(flat["pixel_values"]))
    print(f"  {name}: pan-and-scan gives {np.asarray(scanned['pixel_values']).shape}, crops "
          f"{[int(n) for n in scanned['num_crops']]}")
    return scan


def write_llama4_images() -> None:
    """What transformers' Llama 4 image processor (torchvision) makes of the committed PNGs
    with 16-pixel tiles and up to 6 of them (so that they are cut into several), and the
    llama4_vision checkpoint's preprocessor_config.json (56-pixel tiles, up to 4)."""
    from PIL import Image
    from transformers import Llama4ImageProcessor
    images = [Image.open(IMAGES_DIR / f"{n}.png") for n in ("landscape", "portrait",
                                                           "square_rgba")]
    small = Llama4ImageProcessor(size={"height": 16, "width": 16}, max_patches=6)
    out = small(images, return_tensors="pt")
    np.savez(IMAGES_DIR / "llama4_processor.npz",
             pixel_values=out["pixel_values"].float().numpy(),
             aspect_ratios=np.asarray(out["aspect_ratios"]))
    Llama4ImageProcessor(size={"height": 56, "width": 56}, max_patches=4).save_pretrained(
        mf.FIXTURES_DIR / "llama4_vision")
    print(f"  llama4 images: {tuple(out['pixel_values'].shape)} tiles, aspect ratios "
          f"{np.asarray(out['aspect_ratios']).tolist()}")


RESIZE_CASES = (((37, 53), (16, 20)), ((12, 9), (31, 40)), ((29, 41), (60, 17)),
                ((50, 50), (50, 23)), ((7, 300), (7, 13)), ((1, 5), (3, 1)))


def write_torchvision_resizes() -> None:
    """torchvision's antialiased uint8 resize (bilinear and bicubic) of seeded random RGB
    images: shrinking, enlarging, both at once, one axis only, a 23x shrink, 1-pixel sides."""
    import torch
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as tvF
    rng = np.random.default_rng(7)
    arrays = {}
    for i, (size, target) in enumerate(RESIZE_CASES):
        image = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
        arrays[f"input_{i}"] = image
        chw = torch.from_numpy(image).permute(2, 0, 1).contiguous()
        for name, mode in (("bilinear", InterpolationMode.BILINEAR),
                           ("bicubic", InterpolationMode.BICUBIC)):
            out = tvF.resize(chw, list(target), interpolation=mode, antialias=True)
            arrays[f"{name}_{i}"] = out.permute(1, 2, 0).numpy()
    np.savez(IMAGES_DIR / "torchvision_resize.npz", **arrays)
    print(f"  torchvision resizes: {len(RESIZE_CASES)} images, torch {torch.__version__}")


def write_gemma3_torchvision() -> None:
    """What transformers' torchvision Gemma 3 image processor (its default when torchvision
    is installed) makes of the committed PNGs, with write_images' two settings."""
    from PIL import Image
    from transformers.models.gemma3.image_processing_gemma3 import Gemma3ImageProcessor
    images = [Image.open(IMAGES_DIR / f"{n}.png") for n in ("landscape", "portrait",
                                                           "square_rgba")]
    write_gemma3_processor_outputs(Gemma3ImageProcessor, images, "gemma3_processor_torchvision")


PAN_AND_SCAN_TEXT = "<bos>Look at <start_of_image> then at <start_of_image>, and say."


def write_gemma3_tokenizer(out: Path) -> None:
    """A byte-level tokenizer (no merges) whose specials sit at the ids the gemma3_vision
    checkpoint uses: <start_of_image> 297, <end_of_image> 298, <image_soft_token> 299."""

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    front = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
    back = [f"<unused{i}>" for i in range(BOI_ID - 5 - 256)]
    images = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
    tokens = [*front, *pre_tokenizers.ByteLevel.alphabet(), *back, *images]
    assert len(tokens) == VOCAB and tokens.index("<start_of_image>") == BOI_ID
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in [*front, *back, *images]])
    tok.save(str(out / "tokenizer.json"))
    extra = {"boi_token": images[0], "eoi_token": images[1], "image_token": images[2]}
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
              "tokenizer_class": "PreTrainedTokenizerFast", **extra,
              "extra_special_tokens": extra}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_gemma3_pan_and_scan() -> None:
    """The gemma3_vision checkpoint gets a tokenizer, and ``pan_and_scan.npz`` what
    transformers' Gemma3Processor (Pillow backend, pan-and-scan on with the checkpoint's
    settings) and model make of PAN_AND_SCAN_TEXT with the landscape PNG (3 crops) and the RGBA
    square (none): input_ids, pixel_values, logits."""
    from PIL import Image
    from transformers import Gemma3Processor, PreTrainedTokenizerFast
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    case = mf.FIXTURES_DIR / "gemma3_vision"
    write_gemma3_tokenizer(case)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(case)
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil.from_pretrained(case),
                                tokenizer=tokenizer, image_seq_length=16)
    images = [Image.open(IMAGES_DIR / n) for n in ("landscape.png", "square_rgba.png")]
    # The processor's own defaults turn pan-and-scan off whatever the image processor says.
    out = processor(text=[PAN_AND_SCAN_TEXT], images=[images], return_tensors="pt",
                    do_pan_and_scan=True, pan_and_scan_min_crop_size=8,
                    pan_and_scan_max_num_crops=3, pan_and_scan_min_ratio_to_activate=1.2)
    model = AutoModelForImageTextToText.from_pretrained(case).eval()
    with torch.no_grad():
        logits = model(input_ids=out["input_ids"], pixel_values=out["pixel_values"],
                       token_type_ids=out["token_type_ids"]).logits
    np.savez(case / "pan_and_scan.npz", input_ids=out["input_ids"].numpy(),
             pixel_values=out["pixel_values"].numpy(), logits=logits.float().numpy())
    print(f"  pan-and-scan: {tuple(out['input_ids'].shape)} ids, "
          f"{tuple(out['pixel_values'].shape)} images")


def main() -> None:
    names = sys.argv[1:] or [*CASES, "llama4_vision", "images", "pan_and_scan"]
    for name in names:
        if name == "images":
            write_images()
        elif name == "pan_and_scan":
            write_gemma3_pan_and_scan()
        elif name == "llama4_vision":
            write_llama4_case(name)
        elif name == "llama4_images":  # needs torchvision; writes every torchvision reference
            write_llama4_images()
            write_torchvision_resizes()
            write_gemma3_torchvision()
        else:
            write_case(name)


if __name__ == "__main__":
    main()
