"""Loading a model by hub name, against a real HTTP server started here that answers as the hub's storage
does: a part with no weights is built from scratch with a warning; a failing download is retried and then
fails; it never silently becomes "no weights"."""

import logging
import os
import shutil

import pytest
from servers import serve

from ldm.models import build
from ldm.models.build import PRESETS_DIR, ModelSourceError, build_components

REPO = "org/tiny"


@pytest.fixture
def hub(tmp_path, monkeypatch, request):
    """A hub holding the ldm-tiny configs (or the preset a test names by `indirect` parametrisation) as `org/tiny`;
    returns (repo folder, failures by URL path)."""
    from ppdiffusers.utils import download_utils

    root = tmp_path / "hub"
    repo = root / "models" / "community" / REPO
    shutil.copytree(PRESETS_DIR / getattr(request, "param", "ldm-tiny"), repo)
    with serve(root) as (endpoint, server):
        monkeypatch.setattr(download_utils, "PPDIFFUSERS_BOS_URL_TEMPLATE",
                            endpoint + "/{repo_type}/community/{repo_id}/{revision}/{filename}")
        monkeypatch.setattr(download_utils, "PPDIFFUSERS_CACHE", str(tmp_path / "cache"))
        monkeypatch.setattr(build, "HUB_BACKOFF_SECONDS", 0.01)
        yield repo, server.failures


def test_parts_the_repository_has_no_weights_for_are_built_from_scratch_loudly(hub, caplog):
    with caplog.at_level(logging.WARNING, logger="ldm.models"):
        components = build_components(REPO)
    assert components.pretrained == {"unet": False, "text_encoder": False, "vae": False}
    for part in ("unet", "bert", "vqvae"):
        assert f"{REPO} on the model hub has no weights for {part}/" in caplog.text


@pytest.mark.parametrize("hub", ["sd-tiny"], indirect=True)
def test_a_stable_diffusion_repository_brings_its_text_encoder_and_tokenizer(hub, caplog):
    from ppdiffusers.transformers import CLIPTextModel

    from ldm.models.text import load_text_tokenizer

    repo, _ = hub
    CLIPTextModel(CLIPTextModel.config_class(**build.read_config(repo / "text_encoder"))).save_pretrained(
        str(repo / "text_encoder"), safe_serialization=True)
    with caplog.at_level(logging.WARNING, logger="ldm.models"):
        components = build_components(REPO)
    assert components.family.name == "clip"
    assert components.pretrained == {"unet": False, "text_encoder": True, "vae": False}
    for part in ("unet", "vae"):
        assert f"{REPO} on the model hub has no weights for {part}/" in caplog.text
    tokenizer = load_text_tokenizer(components.family, os.path.join(components.source, "tokenizer"))
    assert tokenizer("a photo")["input_ids"][0] == tokenizer.bos_token_id


def test_a_failing_download_is_retried_and_then_fails_instead_of_training_from_scratch(hub, tmp_path, monkeypatch):
    from ppdiffusers import UNet2DConditionModel
    from ppdiffusers.utils import download_utils

    repo, failures = hub
    UNet2DConditionModel.from_config(build.read_config(repo / "unet")).save_pretrained(str(repo / "unet"))
    weights = [name for name in build.WEIGHT_FILES if (repo / "unet" / name).exists()]
    assert weights, list((repo / "unet").iterdir())
    path = f"/models/community/{REPO}/unet/{weights[0]}"

    failures[path] = 3  # a blip: the first attempt and part of the second fail
    assert build_components(REPO).pretrained["unet"] is True
    assert failures[path] == 0

    monkeypatch.setattr(download_utils, "PPDIFFUSERS_CACHE", str(tmp_path / "cache2"))
    failures[path] = 1000  # down for good
    with pytest.raises(ModelSourceError, match=rf"cannot download unet/{weights[0]} .* after 3 attempts .*HTTP 503"):
        build_components(REPO)


def test_an_autoencoder_by_hub_name_fetches_that_part_alone(hub, tmp_path):
    from ppdiffusers import AutoencoderKL

    repo, _ = hub
    AutoencoderKL.from_config(build.read_config(repo / "vqvae")).save_pretrained(str(repo / "vqvae"))
    folder = build.vae_folder(REPO)  # vqvae/ or vae/ of the repository
    assert build.has_weights(folder) and os.path.basename(folder) == "vqvae"
    assert str(tmp_path / "cache") in folder
    assert sorted(os.listdir(os.path.dirname(folder))) == ["vqvae"]  # not the whole pipeline
    assert build.vae_folder(f"{REPO}/vqvae") == folder
    with pytest.raises(ModelSourceError, match="has no vae/config.json: not an autoencoder"):
        build.vae_folder(f"{REPO}/vae")
    shutil.copytree(PRESETS_DIR / "ldm-tiny" / "vqvae", repo.parent / "configs-only" / "vae")
    with pytest.raises(ModelSourceError, match="org/configs-only/vae on the model hub has an autoencoder config but "
                                               "no weights"):
        build.vae_folder("org/configs-only")


def test_a_hub_name_offline_fails_clearly_naming_the_preset(monkeypatch):
    monkeypatch.setattr(build, "HUB_BACKOFF_SECONDS", 0.01)
    with pytest.raises(ModelSourceError, match="ldm-32layer"):
        build_components("CompVis/ldm_laion400M_pretrain")
    with pytest.raises(ModelSourceError, match="'sd-1.5' has the same architecture.*--init_from_checkpoint"):
        build_components("runwayml/stable-diffusion-v1-5")
    with pytest.raises(ModelSourceError, match="model not found"):
        build_components("./no/such/folder")
