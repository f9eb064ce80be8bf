"""CLIP score of images and their captions, with a CLIP in Hugging Face's format run by PaddleNLP, offline.

The folder is what openai/clip-vit-large-patch14 is distributed as: `config.json`, `model.safetensors`,
`vocab.json`, `merges.txt`, `preprocessor_config.json`. Its weights load into PaddleNLP's `CLIPModel` without
pickle and without the network, by a fixed renaming (`paddle_state`): Hugging Face's encoder layers are Paddle
`TransformerEncoder` layers in PaddleNLP (`encoder.layers.N.mlp.fc1` is `transformer.layers.N.linear1`, ...) and
every Linear weight is stored transposed ([in, out] in Paddle, [out, in] in torch).

Images are prepared as the folder's preprocessor_config.json says, as transformers' PIL image processor does:
the shorter side resized (bicubic) to `size` (the longer side `int(size * long / short)`), a center crop of
`crop_size`, x / 255, normalised by `image_mean` / `image_std`. Captions are tokenized with the folder's BPE
and truncated to the text model's `max_position_embeddings` tokens (77) keeping the end-of-text token the text
model pools at, as `tokenizer(..., truncation=True)` does. (torchmetrics cuts the ids after tokenizing instead,
which drops that token from a longer caption; the two agree on captions of up to 77 tokens.)

Per sample: 100 * cos(image embedding, caption embedding), unclamped. The score: the mean over samples of
max(100 * cos, 0), the formula torchmetrics documents (its code clamps the mean instead: the two agree while no
sample is negative, as with a real CLIP and real captions).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence

import numpy as np
from PIL import Image

from ldm.runtime.errors import UserError

FILES = ("config.json", "model.safetensors", "vocab.json", "merges.txt", "preprocessor_config.json")


class ClipError(UserError, ValueError):
    """A CLIP folder, images or captions that cannot give a CLIP score (one line: what and how to fix it)."""


# -- weights -------------------------------------------------------------------------------------------
_RENAMES = [  # Hugging Face name (regex) -> PaddleNLP name, whether the array is a Linear weight to transpose
    (r"text_model\.embeddings\.token_embedding\.weight", "text_model.token_embedding.weight", False),
    (r"text_model\.embeddings\.position_embedding\.weight", "text_model.positional_embedding.weight", False),
    (r"text_model\.final_layer_norm\.(weight|bias)", r"text_model.ln_final.\1", False),
    (r"vision_model\.embeddings\.class_embedding", "vision_model.class_embedding", False),
    (r"vision_model\.embeddings\.patch_embedding\.weight", "vision_model.conv1.weight", False),
    (r"vision_model\.embeddings\.position_embedding\.weight", "vision_model.positional_embedding.weight", False),
    (r"vision_model\.pre_layrnorm\.(weight|bias)", r"vision_model.ln_pre.\1", False),
    (r"vision_model\.post_layernorm\.(weight|bias)", r"vision_model.ln_post.\1", False),
    (r"(text|vision)_model\.encoder\.layers\.(\d+)\.self_attn\.(q|k|v|out)_proj\.weight",
     r"\1_model.transformer.layers.\2.self_attn.\3_proj.weight", True),
    (r"(text|vision)_model\.encoder\.layers\.(\d+)\.self_attn\.(q|k|v|out)_proj\.bias",
     r"\1_model.transformer.layers.\2.self_attn.\3_proj.bias", False),
    (r"(text|vision)_model\.encoder\.layers\.(\d+)\.layer_norm([12])\.(weight|bias)",
     r"\1_model.transformer.layers.\2.norm\3.\4", False),
    (r"(text|vision)_model\.encoder\.layers\.(\d+)\.mlp\.fc([12])\.weight",
     r"\1_model.transformer.layers.\2.linear\3.weight", True),
    (r"(text|vision)_model\.encoder\.layers\.(\d+)\.mlp\.fc([12])\.bias",
     r"\1_model.transformer.layers.\2.linear\3.bias", False),
    (r"text_projection\.weight", "text_projection", True),
    (r"visual_projection\.weight", "vision_projection", True),
    (r"logit_scale", "logit_scale", False),
]
_IGNORED = re.compile(r"(text|vision)_model\.embeddings\.position_ids")  # a buffer older exports saved


def paddle_state(hf_state: dict[str, np.ndarray], source: str = "model.safetensors") -> dict[str, np.ndarray]:
    """Hugging Face CLIPModel weights under PaddleNLP's CLIPModel names (Linear weights transposed)."""
    out = {}
    for name, value in hf_state.items():
        if _IGNORED.fullmatch(name):
            continue
        for pattern, target, transpose in _RENAMES:
            if re.fullmatch(pattern, name):
                out[re.sub(pattern, target, name)] = np.ascontiguousarray(value.T) if transpose else value
                break
        else:
            raise ClipError(f"{source}: unknown weight {name!r}: not a Hugging Face CLIPModel (a ViT CLIP) checkpoint")
    return out


def _merged(config: dict, part: str) -> dict:
    """A tower's config: `<part>_config`, overridden by `<part>_config_dict` (openai's 2021 config.json has both)."""
    merged = dict(config.get(f"{part}_config") or {})
    merged.update(config.get(f"{part}_config_dict") or {})
    return merged


TEXT_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "max_position_embeddings", "hidden_act", "layer_norm_eps", "bos_token_id", "eos_token_id", "pad_token_id")
VISION_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels",
               "image_size", "patch_size", "hidden_act", "layer_norm_eps")


def paddle_config(config: dict):
    """PaddleNLP's CLIPConfig of a Hugging Face config.json (the projection size is the top-level one, which
    Hugging Face's CLIPModel uses; the towers' own `projection_dim` is for the *WithProjection models)."""
    from paddlenlp.transformers import CLIPConfig

    text, vision = _merged(config, "text"), _merged(config, "vision")
    return CLIPConfig(text_config={k: text[k] for k in TEXT_KEYS if k in text},
                      vision_config={k: vision[k] for k in VISION_KEYS if k in vision},
                      projection_dim=config.get("projection_dim", 512),
                      logit_scale_init_value=config.get("logit_scale_init_value", 2.6592))


# -- images --------------------------------------------------------------------------------------------
def _side(value, key: str) -> int:
    return int(value[key] if isinstance(value, dict) else value)


class ImagePreprocessor:
    """transformers' CLIP image processing (PIL backend) as a preprocessor_config.json describes it."""

    def __init__(self, config: dict):
        size = config.get("size", 224)
        self.shortest_edge = _side(size, "shortest_edge") if not (isinstance(size, dict) and "height" in size) \
            else None
        self.size_hw = (int(size["height"]), int(size["width"])) if self.shortest_edge is None else None
        crop = config.get("crop_size", size)
        self.crop_hw = (int(crop["height"]), int(crop["width"])) if isinstance(crop, dict) and "height" in crop \
            else (_side(crop, "shortest_edge"),) * 2
        self.do_resize = config.get("do_resize", True)
        self.do_center_crop = config.get("do_center_crop", True)
        self.do_rescale = config.get("do_rescale", True)
        self.rescale_factor = float(config.get("rescale_factor", 1 / 255))
        self.do_normalize = config.get("do_normalize", True)
        self.mean = np.asarray(config.get("image_mean", [0.48145466, 0.4578275, 0.40821073]), np.float32)
        self.std = np.asarray(config.get("image_std", [0.26862954, 0.26130258, 0.27577711]), np.float32)
        self.resample = int(config.get("resample", Image.BICUBIC))

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        if self.size_hw:
            return self.size_hw
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)

    def __call__(self, image) -> np.ndarray:
        """float32 [3, crop, crop] of a uint8 [H, W, 3] image (a float one in [0, 1] is rounded to uint8 first)."""
        array = np.asarray(image)
        if np.issubdtype(array.dtype, np.floating):
            array = np.clip(np.round(array * 255), 0, 255).astype(np.uint8)
        if array.ndim != 3 or array.shape[2] != 3 or array.dtype != np.uint8:
            raise ClipError(f"an image of shape {array.shape} and dtype {array.dtype}: expected uint8 [H, W, 3]")
        if self.do_resize:
            height, width = self.output_size(*array.shape[:2])
            array = np.asarray(Image.fromarray(array).resize((width, height), resample=self.resample))
        if self.do_center_crop:
            array = center_crop(array, *self.crop_hw)
        x = array.astype(np.float32)
        if self.do_rescale:
            x = x * np.float32(self.rescale_factor)
        if self.do_normalize:
            x = (x - self.mean) / self.std
        return x.transpose(2, 0, 1)


def center_crop(array: np.ndarray, crop_h: int, crop_w: int) -> np.ndarray:
    """transformers' center crop: top-left at ((H - h) // 2, (W - w) // 2), zero padding where the image is smaller."""
    height, width = array.shape[:2]
    top, left = (height - crop_h) // 2, (width - crop_w) // 2
    if top >= 0 and left >= 0:
        return array[top:top + crop_h, left:left + crop_w]
    padded = np.zeros((max(crop_h, height), max(crop_w, width), array.shape[2]), array.dtype)
    pad_top, pad_left = -(-(padded.shape[0] - height) // 2), -(-(padded.shape[1] - width) // 2)
    padded[pad_top:pad_top + height, pad_left:pad_left + width] = array
    top, left = (padded.shape[0] - crop_h) // 2, (padded.shape[1] - crop_w) // 2
    return padded[top:top + crop_h, left:left + crop_w]


# -- the scorer ------------------------------------------------------------------------------------------
def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ClipError(f"{path}: not readable JSON ({e})") from None


class ClipScorer:
    """A CLIP loaded from a Hugging Face-format folder: `scores(images, captions)` -> per-sample 100 * cos."""

    def __init__(self, folder: str, batch_size: int = 32):
        missing = [name for name in FILES if not os.path.isfile(os.path.join(folder, name))]
        if not os.path.isdir(folder):
            raise ClipError(f"--clip {folder}: no such folder; give a CLIP folder in Hugging Face's format ("
                            f"{', '.join(FILES)}), e.g. a local copy of openai/clip-vit-large-patch14")
        if missing:
            hint = " (pickled pytorch_model.bin weights are not loaded: convert them to model.safetensors)" \
                if "model.safetensors" in missing and os.path.isfile(os.path.join(folder, "pytorch_model.bin")) else ""
            raise ClipError(f"--clip {folder}: lacks {', '.join(missing)}{hint}; a CLIP folder in Hugging Face's "
                            "format has all of " + ", ".join(FILES))
        import paddle
        from paddlenlp.transformers import CLIPModel, CLIPTokenizer
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        config = _read_json(os.path.join(folder, "config.json"))
        if config.get("model_type", "clip") != "clip":
            raise ClipError(f"{folder}/config.json: model_type {config.get('model_type')!r}, not 'clip'")
        self.config = paddle_config(config)
        self.max_length = int(self.config.text_config.max_position_embeddings)
        self.preprocess = ImagePreprocessor(_read_json(os.path.join(folder, "preprocessor_config.json")))
        image_size = int(self.config.vision_config.image_size)
        if self.preprocess.crop_hw != (image_size, image_size):
            raise ClipError(f"{folder}: preprocessor_config.json crops {self.preprocess.crop_hw} but the vision model "
                            f"takes {image_size}x{image_size} images")
        try:
            hf_state = load_file(os.path.join(folder, "model.safetensors"))
        except (SafetensorError, OSError, ValueError) as e:
            raise ClipError(f"{folder}/model.safetensors: not a readable safetensors file ({e})") from None
        state = paddle_state(hf_state, f"{folder}/model.safetensors")
        self.model = CLIPModel(self.config)
        expected = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}
        if "logit_scale" in state:
            state["logit_scale"] = np.asarray(state["logit_scale"]).reshape(expected["logit_scale"])
        unknown = sorted(set(state) - set(expected))
        missing = sorted(set(expected) - set(state))
        if unknown or missing:
            what = f"unknown {unknown[:2]}" if unknown else f"missing {missing[:2]}"
            raise ClipError(f"{folder}/model.safetensors does not fit its config.json ({what}"
                            f"{' ...' if len(unknown or missing) > 2 else ''})")
        wrong = [k for k in expected if tuple(state[k].shape) != expected[k]]
        if wrong:
            raise ClipError(f"{folder}/model.safetensors: {wrong[0]} has shape {tuple(state[wrong[0]].shape)}, its "
                            f"config.json gives {expected[wrong[0]]}")
        self.model.set_state_dict({k: np.asarray(v, np.float32) for k, v in state.items()})
        self.model.eval()
        self.tokenizer = CLIPTokenizer(os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt"),
                                       max_len=self.max_length)
        self.batch_size = batch_size
        self._paddle = paddle

    def tokenize(self, captions: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, attention_mask) int64 [N, L], each caption truncated to the text model's length."""
        encoded = self.tokenizer(list(captions), padding=True, truncation=True, max_length=self.max_length,
                                 return_attention_mask=True)
        return np.asarray(encoded["input_ids"], np.int64), np.asarray(encoded["attention_mask"], np.int64)

    def image_embeddings(self, images) -> np.ndarray:
        paddle = self._paddle
        out = []
        for start in range(0, len(images), self.batch_size):
            pixels = np.stack([self.preprocess(image) for image in images[start:start + self.batch_size]])
            with paddle.no_grad():
                out.append(self.model.get_image_features(pixel_values=paddle.to_tensor(pixels)).numpy())
        return np.concatenate(out)

    def text_embeddings(self, captions: Sequence[str]) -> np.ndarray:
        paddle = self._paddle
        out = []
        for start in range(0, len(captions), self.batch_size):
            ids, mask = self.tokenize(captions[start:start + self.batch_size])
            with paddle.no_grad():
                out.append(self.model.get_text_features(input_ids=paddle.to_tensor(ids),
                                                        attention_mask=paddle.to_tensor(mask)).numpy())
        return np.concatenate(out)

    def scores(self, images, captions: Sequence[str]) -> np.ndarray:
        """Per-sample 100 * cos (float64 [N], unclamped) of uint8 [H, W, 3] images (or float in [0, 1])."""
        images = list(images)
        if len(images) != len(captions):
            raise ClipError(f"{len(images)} images and {len(captions)} captions: give one caption per image")
        if not images:
            raise ClipError("no images to score")
        a = self.image_embeddings(images).astype(np.float64)
        b = self.text_embeddings(list(captions)).astype(np.float64)
        a /= np.linalg.norm(a, axis=-1, keepdims=True)
        b /= np.linalg.norm(b, axis=-1, keepdims=True)
        return 100 * (a * b).sum(-1)

    def clip_score(self, images, captions: Sequence[str]) -> tuple[float, np.ndarray]:
        """(the CLIP score, per-sample 100 * cos) of images and their captions."""
        per_sample = self.scores(images, captions)
        return aggregate(per_sample), per_sample


def aggregate(per_sample) -> float:
    """The CLIP score of per-sample 100 * cos values: the mean of max(value, 0)."""
    return float(np.mean(np.maximum(np.asarray(per_sample, np.float64), 0)))
