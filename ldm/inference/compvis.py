"""The original latent-diffusion text-to-image checkpoint (CompVis' `txt2img-f8-large`, configured by
`txt2img-1p4B-eval.yaml`) as an `LDMTextToImagePipeline` (`python -m ldm.export --from_compvis`).

Its Lightning checkpoint keeps the parts under `model.diffusion_model.` (the openaimodel UNet with spatial
transformers), `first_stage_model.` (the KL autoencoder) and `cond_stage_model.transformer.` (the BERT embedder:
the x-transformers `TransformerWrapper` vendored in latent-diffusion's `ldm/modules/x_transformer.py`). Each key is
renamed to diffusers' layout, then set as any diffusers folder's weights are (`ldm.models.torch_layout`). The UNet
and autoencoder rules are those of diffusers' `convert_ldm_original_checkpoint_to_diffusers.py` /
`convert_ldm_vae_checkpoint`, written out here as rules rather than copied (diffusers is PyTorch-only). No
released script converts the BERT embedder: its rules (pre-norm attention and feed-forward pairs to LDMBert's
layers) are here, checked against the original code's outputs (tests/reference/make_interop_fixtures.py).

A key no rule places, and a weight the model needs that the checkpoint lacks, are errors naming them: a
checkpoint of another architecture is refused, not half loaded.
"""

from __future__ import annotations

import re

import numpy as np

from ldm.runtime.errors import UserError

# the DDPM schedule's buffers, derived from the config's betas: not weights (`betas` is checked against the config)
SCHEDULE_BUFFERS = {"betas", "alphas_cumprod", "alphas_cumprod_prev", "sqrt_alphas_cumprod",
                    "sqrt_one_minus_alphas_cumprod", "log_one_minus_alphas_cumprod", "sqrt_recip_alphas_cumprod",
                    "sqrt_recipm1_alphas_cumprod", "posterior_variance", "posterior_log_variance_clipped",
                    "posterior_mean_coef1", "posterior_mean_coef2", "logvar", "lvlb_weights", "scale_factor"}
UNET, VAE, BERT, EMA = "model.diffusion_model.", "first_stage_model.", "cond_stage_model.transformer.", "model_ema."
PREDICTION = {"eps": "epsilon", "v": "v_prediction", "x0": "sample"}


class CompVisError(UserError, ValueError):
    """A CompVis checkpoint or config this converter cannot turn into a pipeline. One line."""


# -- configs ------------------------------------------------------------------------------------------------
def read_compvis_config(path: str) -> dict:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
        params = config["model"]["params"]
        target = config["model"]["target"]
        parts = {name: params[f"{name}_config"] for name in ("unet", "first_stage", "cond_stage")}
    except (OSError, yaml.YAMLError) as e:
        raise CompVisError(f"--config {path}: cannot read it ({e})") from None
    except (KeyError, TypeError):
        raise CompVisError(f"--config {path}: not a latent-diffusion config (model.params.unet_config, "
                           "first_stage_config and cond_stage_config)") from None
    if not target.endswith("LatentDiffusion") or not parts["cond_stage"].get("target", "").endswith("BERTEmbedder"):
        raise CompVisError(f"--config {path}: a {target} conditioned by {parts['cond_stage'].get('target')}; only "
                           "text-to-image models with the BERT embedder (txt2img-1p4B) are converted")
    return config


def unet_config(unet: dict) -> dict:
    """diffusers' UNet2DConditionModel config of an openaimodel UNetModel's parameters."""
    if not unet.get("use_spatial_transformer") or unet.get("num_head_channels", -1) != -1:
        raise CompVisError("the UNet has no spatial transformers or sets num_head_channels: not the txt2img layout")
    mult, attention = unet["channel_mult"], unet["attention_resolutions"]
    down = ["CrossAttnDownBlock2D" if 2 ** level in attention else "DownBlock2D" for level in range(len(mult))]
    return {"sample_size": unet["image_size"], "in_channels": unet["in_channels"],
            "out_channels": unet["out_channels"], "block_out_channels": [unet["model_channels"] * m for m in mult],
            "layers_per_block": unet["num_res_blocks"], "attention_head_dim": unet["num_heads"],  # heads, as named
            "cross_attention_dim": unet["context_dim"], "down_block_types": down,
            "up_block_types": [t.replace("Down", "Up") for t in reversed(down)],
            "transformer_layers_per_block": unet.get("transformer_depth", 1),
            "use_linear_projection": unet.get("use_linear_in_transformer", False), "act_fn": "silu",
            "norm_num_groups": 32, "norm_eps": 1e-5, "flip_sin_to_cos": True, "freq_shift": 0,
            "downsample_padding": 1, "mid_block_scale_factor": 1}


def vae_config(first_stage: dict, scale_factor: float) -> dict:
    dd = first_stage["ddconfig"]
    if dd.get("attn_resolutions") or first_stage["embed_dim"] != dd["z_channels"] or not dd.get("double_z", True):
        raise CompVisError("the autoencoder has attention in its levels or embed_dim != z_channels: not a KL-f8 "
                           "autoencoder diffusers' AutoencoderKL can hold")
    levels = len(dd["ch_mult"])
    return {"in_channels": dd["in_channels"], "out_channels": dd["out_ch"], "latent_channels": dd["z_channels"],
            "block_out_channels": [dd["ch"] * m for m in dd["ch_mult"]], "layers_per_block": dd["num_res_blocks"],
            "down_block_types": ["DownEncoderBlock2D"] * levels, "up_block_types": ["UpDecoderBlock2D"] * levels,
            "act_fn": "silu", "norm_num_groups": 32, "sample_size": dd["resolution"], "scaling_factor": scale_factor}


def bert_config(cond: dict) -> dict:
    """LDMBert's config of a BERTEmbedder: x-transformers' Encoder defaults (8 heads of 64, feed-forward x4)."""
    width = cond["n_embed"]
    return {"vocab_size": cond.get("vocab_size", 30522), "max_position_embeddings": cond.get("max_seq_len", 77),
            "d_model": width, "encoder_layers": cond["n_layer"], "encoder_ffn_dim": 4 * width,
            "encoder_attention_heads": 8, "head_dim": 64, "activation_function": "gelu", "dropout": 0.0,
            "attention_dropout": 0.0, "activation_dropout": 0.0, "encoder_layerdrop": 0.0, "pad_token_id": 0}


# -- key rules: original name (under the part's prefix) -> diffusers' name, or None -------------------------
RESNET = {"in_layers.0": "norm1", "in_layers.2": "conv1", "emb_layers.1": "time_emb_proj", "out_layers.0": "norm2",
          "out_layers.3": "conv2", "skip_connection": "conv_shortcut"}
UNET_FIXED = {"time_embed.0": "time_embedding.linear_1", "time_embed.2": "time_embedding.linear_2",
              "input_blocks.0.0": "conv_in", "out.0": "conv_norm_out", "out.2": "conv_out"}


def _resnet(prefix: str, rest: str, names: dict) -> str | None:
    layer, _, leaf = rest.rpartition(".")
    return f"{prefix}.{names[layer]}.{leaf}" if layer in names else None


def unet_key(key: str, layers: int) -> str | None:
    layer, _, leaf = key.rpartition(".")
    if layer in UNET_FIXED:
        return f"{UNET_FIXED[layer]}.{leaf}"
    if m := re.fullmatch(r"input_blocks\.(\d+)\.(\d)\.(.+)", key):
        level, index = divmod(int(m[1]) - 1, layers + 1)
        j, rest = int(m[2]), m[3]
        if index == layers:  # the level's downsampler
            return f"down_blocks.{level}.downsamplers.0.conv.{rest[3:]}" if rest.startswith("op.") else None
        if j == 0:
            return _resnet(f"down_blocks.{level}.resnets.{index}", rest, RESNET)
        return f"down_blocks.{level}.attentions.{index}.{rest}" if j == 1 else None
    if m := re.fullmatch(r"middle_block\.(\d)\.(.+)", key):
        if m[1] == "1":
            return f"mid_block.attentions.0.{m[2]}"
        return _resnet(f"mid_block.resnets.{int(m[1]) // 2}", m[2], RESNET)
    if m := re.fullmatch(r"output_blocks\.(\d+)\.(\d)\.(.+)", key):
        level, index = divmod(int(m[1]), layers + 1)
        j, rest = int(m[2]), m[3]
        if j == 0:
            return _resnet(f"up_blocks.{level}.resnets.{index}", rest, RESNET)
        if rest.startswith("conv."):  # the upsampler, after the attention when there is one
            return f"up_blocks.{level}.upsamplers.0.{rest}"
        return f"up_blocks.{level}.attentions.{index}.{rest}" if j == 1 else None
    return None


VAE_RESNET = {"norm1": "norm1", "conv1": "conv1", "norm2": "norm2", "conv2": "conv2", "nin_shortcut": "conv_shortcut"}
VAE_ATTENTION = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}


def vae_key(key: str, levels: int) -> str | None:
    if re.fullmatch(r"(quant_conv|post_quant_conv|(encoder|decoder)\.(conv_in|conv_out))\.(weight|bias)", key):
        return key
    if m := re.fullmatch(r"(encoder|decoder)\.norm_out\.(weight|bias)", key):
        return f"{m[1]}.conv_norm_out.{m[2]}"
    if m := re.fullmatch(r"(encoder|decoder)\.mid\.block_([12])\.(.+)", key):
        return _resnet(f"{m[1]}.mid_block.resnets.{int(m[2]) - 1}", m[3], VAE_RESNET)
    if m := re.fullmatch(r"(encoder|decoder)\.mid\.attn_1\.(\w+)\.(weight|bias)", key):
        return f"{m[1]}.mid_block.attentions.0.{VAE_ATTENTION[m[2]]}.{m[3]}" if m[2] in VAE_ATTENTION else None
    if m := re.fullmatch(r"encoder\.down\.(\d+)\.(block\.(\d+)\.(.+)|downsample\.conv\.(weight|bias))", key):
        if m[3] is not None:
            return _resnet(f"encoder.down_blocks.{m[1]}.resnets.{m[3]}", m[4], VAE_RESNET)
        return f"encoder.down_blocks.{m[1]}.downsamplers.0.conv.{m[5]}"
    if m := re.fullmatch(r"decoder\.up\.(\d+)\.(block\.(\d+)\.(.+)|upsample\.conv\.(weight|bias))", key):
        level = levels - 1 - int(m[1])  # the original counts the decoder's levels from the bottom
        if m[3] is not None:
            return _resnet(f"decoder.up_blocks.{level}.resnets.{m[3]}", m[4], VAE_RESNET)
        return f"decoder.up_blocks.{level}.upsamplers.0.conv.{m[5]}"
    return None


BERT_LAYER = {(0, "0"): "self_attn_layer_norm", (0, "1.to_q"): "self_attn.q_proj", (0, "1.to_k"): "self_attn.k_proj",
              (0, "1.to_v"): "self_attn.v_proj", (0, "1.to_out"): "self_attn.out_proj",
              (1, "0"): "final_layer_norm", (1, "1.net.0.0"): "fc1", (1, "1.net.2"): "fc2"}


def bert_key(key: str) -> str | None:
    """x-transformers' Encoder holds (norm, layer, residual) triples, attention and feed-forward in turn."""
    fixed = {"token_emb.weight": "model.embed_tokens.weight", "pos_emb.emb.weight": "model.embed_positions.weight",
             "norm.weight": "model.layer_norm.weight", "norm.bias": "model.layer_norm.bias",
             "to_logits.weight": "to_logits.weight", "to_logits.bias": "to_logits.bias"}  # a head forward never uses
    if key in fixed:
        return fixed[key]
    if m := re.fullmatch(r"attn_layers\.layers\.(\d+)\.(.+)\.(weight|bias)", key):
        block, kind = divmod(int(m[1]), 2)
        name = BERT_LAYER.get((kind, m[2]))
        return f"model.layers.{block}.{name}.{m[3]}" if name else None
    return None


# -- the conversion -----------------------------------------------------------------------------------------
def split_checkpoint(state: dict[str, np.ndarray], layers: int, levels: int, use_ema: bool
                     ) -> tuple[dict[str, dict[str, np.ndarray]], bool]:
    """({"unet", "vqvae", "bert"}: diffusers-layout state dicts, whether the EMA weights were used); every key
    placed or an error naming those that are not."""
    ema = {key[len(EMA):]: value for key, value in state.items() if key.startswith(EMA)}
    used_ema = use_ema and any(key not in ("decay", "num_updates") for key in ema)
    parts: dict[str, dict[str, np.ndarray]] = {"unet": {}, "vqvae": {}, "bert": {}}
    unplaced = []
    for key, value in state.items():
        name = None
        if key.startswith(UNET):
            name, part = unet_key(key[len(UNET):], layers), "unet"
            if used_ema:  # LitEma names its copies after the wrapper's parameters, dots removed
                flat = ("diffusion_model." + key[len(UNET):]).replace(".", "")
                if flat not in ema:
                    raise CompVisError(f"the checkpoint's EMA has no copy of {key} (pass --no_ema for the raw "
                                       "weights)")
                value = ema[flat]
        elif key.startswith(VAE):
            name, part = vae_key(key[len(VAE):], levels), "vqvae"
            if name and name.endswith(("to_q.weight", "to_k.weight", "to_v.weight", "to_out.0.weight")):
                value = value.reshape(value.shape[:2])  # 1x1 convolutions there, linear layers in diffusers
        elif key.startswith(BERT):
            name, part = bert_key(key[len(BERT):]), "bert"
        elif key.startswith(EMA) or key in SCHEDULE_BUFFERS:
            continue
        if name is None:
            unplaced.append(key)
        else:
            parts[part][name] = value
    if unplaced:
        raise CompVisError(f"{len(unplaced)} key(s) of the checkpoint have no place in the pipeline: "
                           f"{', '.join(unplaced[:6])}{', ...' if len(unplaced) > 6 else ''}")
    return parts, used_ema


def scheduler_config(params: dict) -> dict:
    if params.get("beta_schedule", "linear") != "linear":
        raise CompVisError(f"beta_schedule {params['beta_schedule']}: only the original's 'linear' is converted")
    parameterization = params.get("parameterization", "eps")
    if parameterization not in PREDICTION:
        raise CompVisError(f"parameterization {parameterization}: not one of {', '.join(PREDICTION)}")
    # the original's "linear" schedule is linear in sqrt(beta): diffusers' "scaled_linear"
    return {"beta_start": params.get("linear_start", 1e-4), "beta_end": params.get("linear_end", 2e-2),
            "beta_schedule": "scaled_linear", "num_train_timesteps": params.get("timesteps", 1000),
            "clip_sample": False, "prediction_type": PREDICTION[parameterization]}


def check_betas(state: dict[str, np.ndarray], schedule: dict) -> None:
    if "betas" not in state:
        return
    n = schedule["num_train_timesteps"]
    expected = np.linspace(schedule["beta_start"] ** 0.5, schedule["beta_end"] ** 0.5, n, dtype=np.float64) ** 2
    if state["betas"].shape != (n,) or not np.allclose(state["betas"], expected, rtol=1e-5, atol=1e-8):
        raise CompVisError("the checkpoint's betas are not the schedule its config describes (linear_start, "
                           "linear_end, timesteps): is it the config of this checkpoint?")


def convert_compvis(checkpoint: str, config_path: str, tokenizer_folder: str, output: str, use_ema: bool = True,
                    to_diffusers: bool = False) -> tuple[str, bool]:
    """A pipeline folder from a CompVis txt2img checkpoint and its YAML; (folder, whether EMA weights were used)."""
    from ldm.data.tokenize import TokenizerError, load_tokenizer
    from ldm.inference.export import export_pipeline
    from ldm.inference.model_card import model_card
    from ldm.models.build import part_class
    from ldm.models.pickled import PickleError, read_pickled_weights
    from ldm.models.torch_layout import TorchLayoutError, set_torch_state

    config = read_compvis_config(config_path)
    params = config["model"]["params"]
    unet_params, first_stage = params["unet_config"]["params"], params["first_stage_config"]["params"]
    cond = params["cond_stage_config"]["params"]
    schedule = scheduler_config(params)
    try:
        state, _ = read_pickled_weights(checkpoint)
    except PickleError as e:
        raise CompVisError(str(e)) from None
    check_betas(state, schedule)
    scale = float(state["scale_factor"]) if "scale_factor" in state else params.get("scale_factor", 1.0)
    parts, used_ema = split_checkpoint(state, unet_params["num_res_blocks"],
                                       len(first_stage["ddconfig"]["ch_mult"]), use_ema)
    bert, unet = part_class("bert"), unet_config(unet_params)
    models = {"unet": part_class("unet", unet).from_config(unet),
              "vqvae": part_class("vqvae").from_config(vae_config(first_stage, scale)),
              "bert": bert(bert.config_class(**bert_config(cond)))}
    for name, model in models.items():
        try:
            set_torch_state(model, parts[name], f"{checkpoint} ({name})", config_path)
        except TorchLayoutError as e:
            raise CompVisError(str(e)) from None
    try:
        tokenizer = load_tokenizer(tokenizer_folder, models["bert"].config.max_position_embeddings)
    except TokenizerError as e:
        raise CompVisError(f"--tokenizer: {e}") from None
    if len(tokenizer) != models["bert"].config.vocab_size:
        raise CompVisError(f"--tokenizer {tokenizer_folder} has {len(tokenizer)} tokens and the BERT embedder "
                           f"{models['bert'].config.vocab_size}: not its vocabulary")
    card = model_card(checkpoint, models["unet"], models["bert"], models["vqvae"], schedule, used_ema,
                      f"the CompVis latent-diffusion checkpoint {checkpoint}") if to_diffusers else None
    return export_pipeline(models["unet"], models["bert"], models["vqvae"], tokenizer, schedule, output,
                           to_diffusers, card), used_ema
