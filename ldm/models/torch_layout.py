"""Model parts in PyTorch's layout (diffusers' and transformers' weight files): read into ppdiffusers' and
PaddleNLP's classes, and written from them for `python -m ldm.export --format diffusers`.

The two layouts differ in one thing: a `Linear` weight is (out, in) in PyTorch and (in, out) in Paddle.
ppdiffusers' converters (`convert_pytorch_state_dict_to_paddle` and back) transpose exactly those, found from the
Paddle model's layers. What they leave to the caller is done here, for every part alike:
- reading the files: safetensors, or a `.bin` pickle through the restricted reader (`ldm.models.pickled`), so
  loading a downloaded folder never runs code (ppdiffusers' `from_pretrained` would unpickle it);
- the text encoder: ppdiffusers' `LDMBertPretrainedModel._get_name_mappings` calls `list.extend` with two
  arguments, so `LDMBertModel.from_pretrained(..., from_diffusers=True)` fails (ppdiffusers 0.29). Building the
  model from its config and setting the converted state dict loads it exactly;
- a state dict that does not fit the config (a missing, extra or misshapen tensor) is an error naming it, where
  `set_state_dict` would only warn.
"""

from __future__ import annotations

import json
import os

import numpy as np

from ldm.runtime.errors import UserError

# diffusers' and transformers' weight file names, the safetensors first
TORCH_WEIGHT_FILES = ("diffusion_pytorch_model.safetensors", "model.safetensors", "diffusion_pytorch_model.bin",
                      "pytorch_model.bin")
TORCH_FORMAT = "pt"  # the safetensors metadata diffusers and transformers write; ours say "pd" or "np"


class TorchLayoutError(UserError, ValueError):
    """A PyTorch-layout part that cannot be loaded: unreadable, or not the architecture its config describes."""


def safetensors_format(path: str) -> str | None:
    """The layout a safetensors file's metadata names; None for an unreadable file (its loader says why)."""
    from safetensors import safe_open

    try:
        with safe_open(path, "np") as f:
            return (f.metadata() or {}).get("format")
    except Exception:  # noqa: BLE001 - safetensors raises its own exception types
        return None


def torch_weights_file(folder: str) -> str | None:
    """The PyTorch-layout weights of a part folder, if it holds such (a `model.safetensors` may also be Paddle's:
    told apart by the format its metadata names)."""
    for name in TORCH_WEIGHT_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path) and (name.endswith(".bin") or safetensors_format(path) == TORCH_FORMAT):
            return path
    return None


def is_torch_layout(folder: str) -> bool:
    return torch_weights_file(folder) is not None


def read_torch_weights(path: str) -> dict[str, np.ndarray]:
    from ldm.models.pickled import PickleError, read_pickled_weights

    if path.endswith(".safetensors"):
        from safetensors.numpy import load_file

        try:
            return load_file(path)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own exception types
            raise TorchLayoutError(f"{path}: cannot read it as safetensors ({type(e).__name__}: {e})") from None
    try:
        return read_pickled_weights(path)[0]
    except PickleError as e:
        raise TorchLayoutError(str(e)) from None


def _build(model_class, folder: str):
    """The part its config describes, with fresh weights (replaced by the caller)."""
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    if getattr(model_class, "config_class", None) is not None:  # PaddleNLP's (LDMBert)
        config.pop("architectures", None)
        return model_class(model_class.config_class(**config))
    return model_class.from_config(config)  # ppdiffusers'


def set_torch_state(model, state: dict[str, np.ndarray], source: str, described_by: str) -> None:
    """Set a PyTorch-layout state dict (diffusers' names) into a model built from its config (see the module's
    docstring); `source` and `described_by` name the weights and the config in errors."""
    from ppdiffusers.models.modeling_pytorch_paddle_utils import convert_pytorch_state_dict_to_paddle

    if hasattr(model, "_convert_deprecated_attention_blocks"):  # diffusers' older names (query, key, value, ...)
        model._convert_deprecated_attention_blocks(state)
    state = convert_pytorch_state_dict_to_paddle(model, state)
    expected = model.state_dict()
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        named = "; ".join(f"{what}: {', '.join(names[:4])}{', ...' if len(names) > 4 else ''}"
                          for what, names in (("missing", missing), ("not in the model", extra)) if names)
        raise TorchLayoutError(f"{source} does not fit {described_by} ({named})")
    for name, value in expected.items():
        if tuple(state[name].shape) != tuple(value.shape):
            raise TorchLayoutError(f"{source}: {name} is {tuple(state[name].shape)}, and {tuple(value.shape)} in "
                                   f"the model {described_by} describes")
    model.set_state_dict({name: np.asarray(state[name]).astype(expected[name].numpy().dtype) for name in expected})
    model.eval()


def load_torch_layout(model_class, folder: str):
    """A ppdiffusers or PaddleNLP model from a part folder in PyTorch's layout."""
    path = torch_weights_file(folder)
    if path is None:
        raise TorchLayoutError(f"{folder}: no PyTorch weights ({', '.join(TORCH_WEIGHT_FILES)})")
    model = _build(model_class, folder)
    set_torch_state(model, read_torch_weights(path), path, f"{folder}/config.json")
    return model


def load_pretrained(model_class, folder: str):
    """A part from its folder in either layout: PyTorch's here, Paddle's by the library's `from_pretrained`. A folder
    with no weights file at all (a half-copied or half-converted pipeline) is said to be so, not left to the library
    (whose message names only its own file names)."""
    if is_torch_layout(folder):
        return load_torch_layout(model_class, folder)
    if os.path.isdir(folder) and not any(name.endswith((".safetensors", ".bin", ".pdparams", ".index.json"))
                                         for name in os.listdir(folder)):
        raise FileNotFoundError(f"{folder} holds no weights (only {', '.join(sorted(os.listdir(folder))) or 'nothing'}"
                                "): copy or convert the whole pipeline again")
    return model_class.from_pretrained(folder)


def torch_state(model) -> dict[str, np.ndarray]:
    """A model's weights in PyTorch's layout, as diffusers and transformers read them."""
    from ppdiffusers.models.modeling_pytorch_paddle_utils import convert_paddle_state_dict_to_pytorch

    state = {name: value.numpy() for name, value in model.state_dict().items()}
    converted = convert_paddle_state_dict_to_pytorch(model, state)
    # the converter squeezes 1-element vectors to scalars; PyTorch's parameters keep their shape
    return {name: np.ascontiguousarray(value.reshape(1) if value.ndim == 0 else value)
            for name, value in converted.items()}


def save_torch_layout(model, folder: str, filename: str) -> str:
    """The model's weights in PyTorch's layout as `folder/filename` (safetensors), with the metadata diffusers and
    transformers write; its path."""
    from safetensors.numpy import save_file

    path = os.path.join(folder, filename)
    save_file(torch_state(model), path, metadata={"format": TORCH_FORMAT})
    return path
