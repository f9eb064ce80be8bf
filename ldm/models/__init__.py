"""The model side: presets and building (`build`), initialisation (`init`), the training objective
(`diffusion`), EMA (`ema`)."""
