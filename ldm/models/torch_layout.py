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
# Which variant to read (diffusers' `variant`: `diffusion_pytorch_model.fp16.safetensors`) when a folder holds
# several and no plain weights: LDM_WEIGHTS_VARIANT=fp16. One variant alone is read without being asked.
VARIANT_VARIABLE = "LDM_WEIGHTS_VARIANT"

# (name, the name it is tied to): T5's token embedding is its `shared` table, which transformers writes alone
TIED_WEIGHTS = (("encoder.embed_tokens.weight", "shared.weight"),)
# Buffers of ppdiffusers' classes that no forward reads and diffusers' current classes do not have, read as zero
# where a folder lacks them: PixArt-α's null caption (`y_embedding`, which diffusers 0.22's `Transformer2DModel` kept
# and its `PixArtTransformer2DModel` drops: its pipeline, as this framework, conditions the unconditional branch and
# the dropped captions on the T5 states of the empty caption, with their mask)
UNREAD_BUFFERS = ("caption_projection.y_embedding",)


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


def _variant_name(name: str, variant: str) -> str:
    """diffusers' `_add_variant`: the variant before the last extension (`model.safetensors` ->
    `model.fp16.safetensors`, `model.safetensors.index.json` -> `model.safetensors.index.fp16.json`)."""
    stem, extension = name.rsplit(".", 1)
    return f"{stem}.{variant}.{extension}" if variant else name


def _index_files(index: str) -> list[str]:
    """The files a Hugging Face shard index names (its `weight_map`), as paths beside it."""
    try:
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise TorchLayoutError(f"{index}: not a readable shard index ({e})") from None
    files = [os.path.join(os.path.dirname(index), name) for name in names]
    missing = [name for name, path in zip(names, files, strict=True) if not os.path.isfile(path)]
    if missing:
        raise TorchLayoutError(f"{index} names {', '.join(missing[:3])}, which is not there: copy the whole folder "
                               "again")
    return files


def _torch_files(folder: str, variant: str) -> list[str] | None:
    """The PyTorch-layout weights of `folder` under `variant` ("" for the plain ones): one file, or the shards an
    index names; None when it holds none."""
    for name in TORCH_WEIGHT_FILES:
        path = os.path.join(folder, _variant_name(name, variant))
        if os.path.isfile(path) and (name.endswith(".bin") or safetensors_format(path) == TORCH_FORMAT):
            return [path]
        index = os.path.join(folder, _variant_name(f"{name}.index.json", variant))
        if os.path.isfile(index):
            files = _index_files(index)
            if name.endswith(".bin") or all(safetensors_format(f) == TORCH_FORMAT for f in files):
                return files
    return None


def variants(folder: str) -> list[str]:
    """The weight variants a part folder holds (`fp16` of `diffusion_pytorch_model.fp16.safetensors`)."""
    found = set()
    for entry in os.listdir(folder):
        for name in TORCH_WEIGHT_FILES:
            for form in (name, f"{name}.index.json"):
                stem, extension = form.rsplit(".", 1)
                if entry.startswith(stem + ".") and entry.endswith("." + extension) and entry != form:
                    variant = entry[len(stem) + 1:-len(extension) - 1]
                    if variant and "." not in variant and "-of-" not in variant:
                        found.add(variant)
    return sorted(found)


def torch_weights_files(folder: str) -> list[str] | None:
    """The PyTorch-layout weights of a part folder, if it holds such: one file or the shards of an index (diffusers'
    `max_shard_size`), the plain weights or else a variant (a `model.safetensors` may also be Paddle's: told apart
    by the format its metadata names)."""
    chosen = os.environ.get(VARIANT_VARIABLE, "")
    if chosen:
        files = _torch_files(folder, chosen)
        if files is not None:
            return files
        held = variants(folder) if os.path.isdir(folder) else []
        if chosen not in held:
            raise TorchLayoutError(f"{VARIANT_VARIABLE}={chosen}: {folder} holds no such variant (it holds "
                                   f"{', '.join(held) or 'none'})")
    plain = _torch_files(folder, "")
    if plain is not None or not os.path.isdir(folder):
        return plain
    held = {v: files for v in variants(folder) if (files := _torch_files(folder, v)) is not None}
    if len(held) > 1:
        raise TorchLayoutError(f"{folder} holds the weight variants {', '.join(held)} and no plain weights: choose "
                               f"one with {VARIANT_VARIABLE}={next(iter(held))}")
    return next(iter(held.values()), None)


def is_torch_layout(folder: str) -> bool:
    return torch_weights_files(folder) is not None


def read_torch_weights(path: str) -> dict[str, np.ndarray]:
    from ldm.models.pickled import PickleError, read_pickled_weights

    if path.endswith(".safetensors"):
        try:
            return read_safetensors(path)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own exception types
            raise TorchLayoutError(f"{path}: cannot read it as safetensors ({type(e).__name__}: {e})") from None
    try:
        return read_pickled_weights(path)[0]
    except PickleError as e:
        raise TorchLayoutError(str(e)) from None


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """The arrays of a safetensors file; bfloat16 ones (SD3.5's and PixArt-Σ's releases, any pipeline saved with
    `torch_dtype=torch.bfloat16`), which numpy has no type for, read by safetensors as Paddle tensors and widened to
    float32, exactly (a bfloat16 is the upper half of the float32 of the same value)."""
    from safetensors import safe_open
    from safetensors.numpy import load_file

    with safe_open(path, "np") as f:
        widened = {name for name in f.keys() if f.get_slice(name).get_dtype() == "BF16"}  # noqa: SIM118 - no __iter__
    if not widened:
        return load_file(path)
    state = {}
    with safe_open(path, "np") as plain, safe_open(path, "paddle") as wide:
        for name in plain.keys():  # noqa: SIM118 - no __iter__
            state[name] = (wide.get_tensor(name).astype("float32").numpy() if name in widened
                           else plain.get_tensor(name))
    return state


def _build(model_class, folder: str):
    """The part its config describes, with fresh weights (replaced by the caller)."""
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    if getattr(model_class, "config_class", None) is not None:  # PaddleNLP's (LDMBert)
        config.pop("architectures", None)
        return model_class(model_class.config_class(**config))
    return model_class.from_config(config)  # ppdiffusers'


def with_model_prefix(model, state: dict) -> dict:
    """transformers 5 saves a CLIP text model's weights without the `text_model.` its model (and transformers 4, and
    every Stable Diffusion folder on the hub) names them with: the prefix is put back where every name lacks it."""
    prefixes = {name.split(".", 1)[0] for name in model.state_dict()}
    if len(prefixes) != 1 or not state:
        return state
    prefix = prefixes.pop() + "."
    if any(name.startswith(prefix) for name in state):
        return state
    return {prefix + name: value for name, value in state.items()}


def set_torch_state(model, state: dict[str, np.ndarray], source: str, described_by: str) -> None:
    """Set a PyTorch-layout state dict (diffusers' names) into a model built from its config (see the module's
    docstring); `source` and `described_by` name the weights and the config in errors."""
    from ppdiffusers.models.modeling_pytorch_paddle_utils import convert_pytorch_state_dict_to_paddle

    if hasattr(model, "_convert_deprecated_attention_blocks"):  # diffusers' older names (query, key, value, ...)
        model._convert_deprecated_attention_blocks(state)
    state = with_model_prefix(model, state)
    state = convert_pytorch_state_dict_to_paddle(model, state)
    expected = model.state_dict()
    for tied, original in TIED_WEIGHTS:  # written once, as transformers saves tied weights
        if tied in expected and tied not in state and original in state:
            state[tied] = state[original]
    for name in [*unexported_biases(model), *UNREAD_BUFFERS]:  # diffusers' class has not: as it computes without
        if name in expected and name not in state:
            state[name] = np.zeros(expected[name].shape, np.float32)
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


def unexported_biases(model) -> list[str]:
    """The biases of ppdiffusers' layer norms without affine weights (`ModelFamily.freeze_unexported`:
    SD3's transformer), which diffusers' classes do not have: read as zero from a diffusers folder."""
    import paddle

    return [f"{name}.bias" for name, layer in model.named_sublayers()
            if isinstance(layer, paddle.nn.LayerNorm) and layer.weight is None and layer.bias is not None]


def load_torch_layout(model_class, folder: str):
    """A ppdiffusers or PaddleNLP model from a part folder in PyTorch's layout."""
    files = torch_weights_files(folder)
    if files is None:
        raise TorchLayoutError(f"{folder}: no PyTorch weights ({', '.join(TORCH_WEIGHT_FILES)})")
    model = _build(model_class, folder)
    state: dict[str, np.ndarray] = {}
    for path in files:
        state.update(read_torch_weights(path))
    set_torch_state(model, state, files[0] if len(files) == 1 else f"{folder} ({len(files)} shards)",
                    f"{folder}/config.json")
    return model


def load_pretrained(model_class, folder: str):
    """A part from its folder in either layout: PyTorch's here, Paddle's by the library's `from_pretrained`. A folder
    with no weights file at all (a half-copied or half-converted pipeline) is said to be so, not left to the library
    (whose message names only its own file names)."""
    if getattr(model_class, "composite", False):  # several models' folders (`ldm.models.text_set`)
        return model_class.from_pretrained(folder)
    if not os.path.isdir(folder):  # a symlink loop, a dangling link, a file: one line, not the library's search
        try:
            os.stat(folder)
            why = "not a folder"
        except OSError as e:
            why = e.strerror or str(e)
        raise TorchLayoutError(f"{folder}: cannot be read as a model folder ({why})")
    check_readable(folder)
    if is_torch_layout(folder):
        return load_torch_layout(model_class, folder)
    if os.path.isdir(folder) and not any(name.endswith((".safetensors", ".bin", ".pdparams", ".index.json"))
                                         for name in os.listdir(folder)):
        raise FileNotFoundError(f"{folder} holds no weights (only {', '.join(sorted(os.listdir(folder))) or 'nothing'}"
                                "): copy or convert the whole pipeline again")
    streamed = load_paddle_layout(model_class, folder)
    return streamed if streamed is not None else model_class.from_pretrained(folder)


# the stems of the Paddle-layout weights ppdiffusers' and PaddleNLP's `save_pretrained` write (and checkpoints)
PADDLE_WEIGHT_STEMS = ("diffusion_paddle_model", "model")


def paddle_weight_files(folder: str) -> dict[str, str] | None:
    """{tensor name: file name} of a part folder's Paddle-layout safetensors: one file, or the shards of its index;
    None when it holds none such (the library's own loader reads what else there is)."""
    from ldm.runtime.safetensors_files import StateFormatError, safetensors_entries

    for stem in PADDLE_WEIGHT_STEMS:
        name = f"{stem}.safetensors"
        path, index = os.path.join(folder, name), os.path.join(folder, f"{name}.index.json")
        if os.path.isfile(path) and safetensors_format(path) not in (None, TORCH_FORMAT):
            try:
                return dict.fromkeys(safetensors_entries(path), name)
            except StateFormatError:
                return None
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError):
                return None
            return weight_map if isinstance(weight_map, dict) else None
    return None


def load_paddle_layout(model_class, folder: str):
    """A part from its Paddle-layout safetensors, built without initialising its weights (`paddle.LazyGuard`: no
    memory until a weight is set) and filled one tensor at a time, read with plain reads: the load holds the model
    and one tensor, where the libraries' `from_pretrained` build it with fresh weights and then read the file whole
    beside it (2.5 times the model at its peak). None when the folder's weights are not exactly the model's (a
    tensor missing, extra or misshapen, or of a dtype numpy has not): the library's loader reads those, and says
    what does not fit."""
    import paddle
    from paddlenlp.transformers.model_utils import no_init_weights

    from ldm.runtime.safetensors_files import file_arrays, safetensors_entries

    files = paddle_weight_files(folder)
    if files is None:
        return None
    with paddle.LazyGuard(), no_init_weights(_enable=True):
        model = _build(model_class, folder)
    expected = model.state_dict()
    entries = {}
    for file in set(files.values()):
        path = os.path.join(folder, file)
        if not os.path.isfile(path):
            return None
        entries.update({name: entry for name, entry in safetensors_entries(path).items() if files.get(name) == file})
    parameters = {name for name, _ in model.named_parameters()}
    if set(entries) - set(expected) or parameters - set(entries) or any(
            dtype is None or shape != tuple(expected[name].shape) for name, (dtype, shape) in entries.items()):
        return None
    by_file: dict[str, list[str]] = {}
    for name in sorted(entries):
        by_file.setdefault(files[name], []).append(name)
    with paddle.no_grad():
        for name, array in file_arrays(folder, by_file):
            tensor = expected[name]
            tensor.set_value(array if array.dtype == paddle_numpy_dtype(tensor) else
                             array.astype(paddle_numpy_dtype(tensor)))
    model.eval()
    return model


def paddle_numpy_dtype(tensor) -> np.dtype:
    import paddle

    return np.dtype({paddle.float32: "float32", paddle.float16: "float16", paddle.float64: "float64",
                     paddle.int64: "int64", paddle.int32: "int32", paddle.bool: "bool"}.get(tensor.dtype, "float32"))


def check_readable(folder: str) -> None:
    """Refuse a part whose safetensors file is damaged (cut short by a failed copy or download), naming the file: left
    to them, ppdiffusers says the folder holds no model files and PaddleNLP raises safetensors' own error."""
    from safetensors import safe_open

    for name in sorted(os.listdir(folder)):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(folder, name)
        try:
            with safe_open(path, "np"):  # reads the header and checks the file holds every byte it names
                pass
        except Exception as e:  # noqa: BLE001 - safetensors raises its own exception types
            raise TorchLayoutError(f"{path} is damaged: it cannot be read as safetensors ({e}); copy it again") \
                from None


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
